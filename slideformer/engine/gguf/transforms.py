"""What llama.cpp's converter does to a tensor's values and shape on the way into GGUF, and back.

:func:`to_gguf` is what ``convert_hf_to_gguf.py`` does to one Hugging Face tensor; :func:`from_gguf`
undoes it (export and import share these two, so one cannot drift from the other):

- **Q/K order** (``llama`` and ``smollm3``): llama.cpp rotates interleaved pairs (dims 2i, 2i+1) in
  Llama-style RoPE, Hugging Face rotates halves (i, i + d/2), so the rows of each head of the
  q and k projections (weights and biases) are reordered. Qwen2/Qwen3/Qwen3.5, Gemma 3, Phi-3
  and OLMo 2/3 use llama.cpp's "neox" (halves) RoPE and are stored unchanged.
- **Norms that scale by (1 + w)** (Gemma 3, Qwen3.5: ``Family.norm_offset``) are stored as
  1 + w, the scale llama.cpp multiplies by; Qwen3.5's gated DeltaNet norm
  (``linear_attn.norm``) scales by w and is stored as it is.
- **Qwen3.5's gated DeltaNet** (the converter's ``Qwen3NextModel`` and
  ``_LinearAttentionVReorderBase``): ``A_log`` is stored as ``ssm_a`` = -exp(A_log), the
  decay factor llama.cpp multiplies by; the depthwise convolution (C, 1, K) as (C, K); and
  where there are more value heads than key heads, the value heads go from Hugging Face's
  grouped order (the value heads of key head 0, then of key head 1, ...: transformers
  repeats each key head ``repeat_interleave``) to llama.cpp's tiled order (value head j of
  every key head, for j = 0, 1, ...: ggml broadcasts a key head over the value heads that
  way). That permutes the value rows of ``in_proj_qkv`` and of the convolution, the rows of
  ``in_proj_z``, ``in_proj_a`` and ``in_proj_b``, ``dt_bias`` and ``A_log``, and the columns
  of ``out_proj``.

Permutations and the reshape are exact; ``1 + w`` and ``-exp`` are computed in float64 and
stored in float32, so import gives back the Hugging Face value to float32 rounding (within
one bf16 step of the source, tested).
"""
from __future__ import annotations

import numpy as np

from slideformer.engine.models.spec import ModelSpec

PERMUTED_ARCHS = ("llama", "smollm3")
"""GGUF architectures whose q/k rows llama.cpp's converter reorders (Llama's, and the families
it writes as Llama or as Llama's subclass: Mistral, Mixtral, SmolLM3)."""
_LINEAR = ".linear_attn."


def to_gguf(spec: ModelSpec, hf: str, w: np.ndarray) -> np.ndarray:
    """Hugging Face tensor ``hf`` (fp32) as llama.cpp's converter stores it."""
    if (heads := qk_heads(spec, hf)) is not None:
        w = to_gguf_order(w, heads)
    if shift := norm_shift(spec, hf):
        w = (w.astype(np.float64) + shift).astype(np.float32)
    if hf.endswith(_LINEAR + "A_log"):
        w = (-np.exp(w.astype(np.float64))).astype(np.float32)
    if hf.endswith(_LINEAR + "conv1d.weight"):
        w = w.reshape(w.shape[0], w.shape[2])
    if (where := _value_heads(spec, hf)) is not None:
        w = _regroup(w, *where, groups=(spec.linear.num_k_heads, _per_key(spec)))
    return w


def from_gguf(spec: ModelSpec, hf: str, w: np.ndarray) -> np.ndarray:
    """GGUF data of tensor ``hf`` (fp32) back as the Hugging Face tensor (inverse of
    :func:`to_gguf`). An ``ssm_a`` that is not negative gives NaN or -inf (no A_log has it)."""
    if (where := _value_heads(spec, hf)) is not None:
        w = _regroup(w, *where, groups=(_per_key(spec), spec.linear.num_k_heads))
    if hf.endswith(_LINEAR + "conv1d.weight"):
        w = w.reshape(w.shape[0], 1, w.shape[1])
    if hf.endswith(_LINEAR + "A_log"):
        with np.errstate(invalid="ignore", divide="ignore"):
            w = np.log(-w.astype(np.float64)).astype(np.float32)
    if shift := norm_shift(spec, hf):
        w = (w.astype(np.float64) - shift).astype(np.float32)
    if (heads := qk_heads(spec, hf)) is not None:
        w = from_gguf_order(w, heads)
    return w


def gguf_shape(hf: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape (PyTorch order) tensor ``hf`` of ``shape`` has in GGUF."""
    if hf.endswith(_LINEAR + "conv1d.weight"):
        return shape[0], shape[2]
    return tuple(shape)


def norm_shift(spec: ModelSpec, hf: str) -> float:
    """What llama.cpp's converter adds to tensor ``hf``: the norms' offset (1 + w)."""
    if hf.endswith(_LINEAR + "norm.weight"):  # the gated DeltaNet norm scales by w itself
        return 0.0
    return spec.family.norm_offset if hf.endswith("norm.weight") else 0.0


def qk_heads(spec: ModelSpec, hf: str) -> int | None:
    """Heads whose rows llama.cpp reorders in tensor ``hf`` (None: stored unchanged)."""
    if spec.family.gguf not in PERMUTED_ARCHS:
        return None
    if ".self_attn.q_proj." in hf:
        return spec.num_heads
    if ".self_attn.k_proj." in hf:
        return spec.num_kv_heads
    return None


def to_gguf_order(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from halves order (HF) to interleaved pairs (llama.cpp)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_gguf_order(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of :func:`to_gguf_order`."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _per_key(spec: ModelSpec) -> int:
    return spec.linear.num_v_heads // spec.linear.num_k_heads


def _value_heads(spec: ModelSpec, hf: str) -> tuple[int, int, int] | None:
    """(axis, offset, head size) of the value heads in DeltaNet tensor ``hf`` (its last
    ``num_v_heads`` blocks of that size along the axis), where llama.cpp reorders them;
    None elsewhere."""
    d = spec.linear
    if d is None or d.num_v_heads == d.num_k_heads or _LINEAR not in hf:
        return None
    return {"in_proj_qkv.weight": (0, 2 * d.key_dim, d.head_v_dim),
            "conv1d.weight": (0, 2 * d.key_dim, d.head_v_dim),
            "in_proj_z.weight": (0, 0, d.head_v_dim), "in_proj_a.weight": (0, 0, 1),
            "in_proj_b.weight": (0, 0, 1), "dt_bias": (0, 0, 1), "A_log": (0, 0, 1),
            "out_proj.weight": (1, 0, d.head_v_dim)}.get(hf.rsplit(_LINEAR, 1)[1])


def _regroup(w: np.ndarray, axis: int, offset: int, size: int, groups: tuple[int, int]) -> np.ndarray:
    """The heads after ``offset`` along ``axis``, viewed as (a, b) blocks of ``size``
    (``groups`` = (a, b)), reordered to (b, a): grouped -> tiled with (key heads, value heads
    per key head), tiled -> grouped with the pair swapped."""
    w = np.moveaxis(w, axis, 0)
    heads = w[offset:]
    a, b = groups
    heads = heads.reshape(a, b, size, *heads.shape[1:]).swapaxes(0, 1).reshape(heads.shape)
    return np.moveaxis(np.concatenate([w[:offset], heads]), 0, axis)
