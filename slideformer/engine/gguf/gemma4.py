"""Gemma 4's metadata in GGUF (llama.cpp's ``gemma4``), written and read, and the checks that
refuse what llama.cpp would compute otherwise.

What llama.cpp's loader and graph read (``src/models/gemma4.cpp``) beyond a Gemma 3 file:

- two attention shapes: ``attention.key_length`` / ``value_length`` and
  ``rope.dimension_count`` are the full-attention layers' head size, ``*_swa`` the sliding
  layers'; ``attention.head_count_kv`` one number per layer; which layers slide:
  ``attention.sliding_window_pattern`` (a flag per layer, any pattern), their window
  ``attention.sliding_window`` and their RoPE base ``rope.freq_base_swa``;
- keys as values: a full layer without ``attn_v`` takes its values from ``attn_k``'s output,
  RMS-normed without a weight (every layer's values are), before k's norm and RoPE;
- proportional RoPE on the full layers: the neox RoPE over the whole head, each frequency pair
  divided by the tensor ``rope_freqs.weight`` (one f32 per pair, shared by the full layers):
  1 for the pairs that turn, 1e30 (turning by nothing) for the others, as llama.cpp's converter
  writes it. The proportional RoPE's ``factor`` (and a linear one) divides every full layer's
  frequency: ``rope.scaling.type`` linear and ``rope.scaling.factor``, which llama.cpp applies
  to the full layers only (the sliding layers turn unscaled, whatever the file says);
- ``layer_output_scale.weight``: each layer's ``layer_scalar``; ``final_logit_softcapping``;
- experts beside the dense MLP: ``ffn_gate_up_exps`` (gate the first half), ``ffn_down_exps``,
  the router ``ffn_gate_inp`` with its scale ``ffn_gate_inp.scale`` (on the RMS-normed
  residual stream over sqrt(hidden)), the per-expert scale ``ffn_down_exps.scale``, the norms
  ``pre_ffw_norm_2``, ``post_ffw_norm_1`` and ``post_ffw_norm_2``; softmax over all experts,
  top-k renormalised;
- no per-layer input embeddings (``embedding_length_per_layer_input`` 0) and no KV sharing
  (``attention.shared_kv_layers`` 0): both keys are read, and the family refuses both.

The norms scale by the weight itself: stored unchanged.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from slideformer.engine.errors import UserError
from slideformer.engine.gguf import metadata
from slideformer.engine.models.families.base import FULL, SLIDING
from slideformer.engine.models.layers import rope_inv_freq
from slideformer.engine.models.spec import ModelSpec

ARCH = "gemma4"
STILL = 1e30
"""llama.cpp's divisor of the frequency pairs that do not turn (the converter's value)."""
ROPE_FREQS = "rope_freqs.weight"
MIN_LAYERS = 2
"""llama.cpp's gemma4 asserts two or more layers when it builds its KV cache (it aborts)."""
_KEEP = "keep the model in its Hugging Face folder"
_FIX = "use the GGUF file as llama.cpp's converter wrote it"


# ---- export -----------------------------------------------------------------------------------
def check(spec: ModelSpec, cfg: Path) -> None:
    """Refuse a Gemma 4 that llama.cpp's gemma4 would not load or would compute otherwise
    (RoPE types, window and biases: archs' common checks)."""
    if spec.num_layers < MIN_LAYERS:
        raise UserError(cfg, f"sets num_hidden_layers = {spec.num_layers}, but llama.cpp's "
                        f"gemma4 needs {MIN_LAYERS} or more layers (it stops with an assertion "
                        "when it loads the GGUF)", _KEEP)
    if spec.local_rope is not None and spec.local_rope[1] is not None:
        raise UserError(cfg, "sets a RoPE scaling for the sliding_attention layers "
                        "(rope_parameters.sliding_attention), but llama.cpp's gemma4 turns "
                        "those layers unscaled: it would compute another model",
                        f"{_KEEP} (the Gemma 4 releases give them the default RoPE)")
    for kind in (SLIDING, FULL):
        sizes = sorted({spec.head_dim_of(i) for i in _layers(spec, kind)})
        if len(sizes) > 1:
            raise UserError(cfg, f"gives its {kind} layers head sizes {sizes} (per_layer_config), "
                            f"but llama.cpp's gemma4 has one head size for all {kind} layers "
                            "and would not load the GGUF", _KEEP)


def _layers(spec: ModelSpec, kind: str) -> list[int]:
    return [i for i in range(spec.num_layers) if spec.layer_type(i) == kind]


def full_head_dim(spec: ModelSpec) -> int:
    """The full-attention layers' head size (the last layer is always one)."""
    return spec.head_dim_of(_layers(spec, FULL)[0])


def sliding_head_dim(spec: ModelSpec) -> int:
    """The sliding layers' head size (config.json's ``head_dim`` where none slides)."""
    sliding = _layers(spec, SLIDING)
    return spec.head_dim_of(sliding[0]) if sliding else spec.head_dim


def kv_heads(spec: ModelSpec) -> list[int]:
    """``attention.head_count_kv``: each layer's key-value heads."""
    return [spec.kv_heads_of(i) for i in range(spec.num_layers)]


def _full_rope(spec: ModelSpec) -> tuple[str | None, dict]:
    rs = dict(spec.rope_scaling or ())
    return rs.get("rope_type", rs.get("type")), rs


def rope_freqs(spec: ModelSpec) -> np.ndarray:
    """``rope_freqs.weight``: 1 for each full-layer frequency pair that turns, :data:`STILL`
    for those the proportional RoPE holds still (the engine's own frequencies decide)."""
    kind, rs = _full_rope(spec)
    hd = full_head_dim(spec)
    if kind != "proportional":
        return np.ones(hd // 2, np.float32)
    inv = rope_inv_freq(hd, spec.rope_theta, (("partial_rotary_factor",
                                                 rs.get("partial_rotary_factor", 1.0)),
                                                ("rope_type", "proportional")))
    return np.where(inv.numpy() > 0, 1.0, STILL).astype(np.float32)


def write_metadata(w: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """The keys of Gemma 4 beyond the common ones (after :func:`check`); the common writer
    gives ``key_length``, ``rope.dimension_count`` and ``head_count_kv`` the full layers' and
    per-layer values (:func:`full_head_dim`, :func:`kv_heads`)."""
    hd = sliding_head_dim(spec)
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    w.add_rope_dimension_count_swa(hd)  # transformers turns the whole head of a sliding layer
    w.add_rope_freq_base_swa(spec.local_rope[0] if spec.local_rope else spec.rope_theta)
    w.add_sliding_window(spec.sliding_window)
    w.add_sliding_window_pattern([spec.layer_type(i) == SLIDING for i in range(spec.num_layers)])
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    if spec.logit_softcap is not None:
        w.add_final_logit_softcapping(spec.logit_softcap)
    kind, rs = _full_rope(spec)
    if kind == "proportional" and float(rs.get("factor", 1.0)) != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # full layers only, in llama.cpp
        w.add_rope_scaling_factor(float(rs["factor"]))


# ---- import -----------------------------------------------------------------------------------
def config(g, arch: str, layers: int, cfg: dict) -> dict:
    """The Gemma 4 keys of config.json ``cfg`` (from the common keys) from the metadata and
    ``rope_freqs.weight``."""
    _refuse(g, arch)
    flags = metadata.array(g, f"{arch}.attention.sliding_window_pattern", bool)
    if flags is None or metadata.length(flags) < layers:
        raise UserError(g.path, f"has no '{arch}.attention.sliding_window_pattern' with a flag "
                        f"for each of its {layers} layers", _FIX)
    types = [SLIDING if f else FULL for f in list(flags)[:layers]]
    if types[-1] != FULL:
        raise UserError(g.path, "has a sliding last layer, which Gemma 4 never has (transformers "
                        "makes it a full-attention layer)", _FIX)
    hd_full = _positive(g, f"{arch}.attention.key_length")
    hd = metadata.value(g, f"{arch}.attention.key_length_swa", int, hd_full)
    kv = _kv_heads(g, arch, layers, cfg["num_attention_heads"])
    full = [i for i, t in enumerate(types) if t == FULL]
    k_eq_v = f"blk.{full[0]}.attn_v.weight" not in g.tensors
    out = {"layer_types": types, "head_dim": hd, "global_head_dim": hd_full,
           "attention_k_eq_v": k_eq_v, "attention_bias": False,
           "sliding_window": _positive(g, f"{arch}.attention.sliding_window"),
           "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
           "use_bidirectional_attention": None,
           "final_logit_softcapping": _softcap(g, arch),
           "rope_parameters": _rope(g, arch, hd_full, cfg.pop("rope_theta"),
                                    cfg.pop("rope_scaling", None)),
           "enable_moe_block": g.get(f"{arch}.expert_count") is not None}
    out |= _kv_config(types, hd, hd_full, kv, k_eq_v)
    return {k: v for k, v in cfg.items() if k != "num_global_key_value_heads"} | out


def _refuse(g, arch: str) -> None:
    """Per-layer input embeddings and KV sharing (E2B's and E4B's): not trained here."""
    for key, what in (("embedding_length_per_layer_input", "per-layer input embeddings"),
                      ("attention.shared_kv_layers", "layers that share earlier layers' keys "
                                                     "and values")):
        if metadata.value(g, f"{arch}.{key}", int, 0):
            raise UserError(g.path, f"is a Gemma 4 with {what} ('{arch}.{key}', as E2B and "
                            "E4B have), which this engine does not train",
                            "import Gemma 4 31B or 26B-A4B, or use another tool for E2B and E4B")


def _positive(g, key: str) -> int:
    v = metadata.value(g, key, int)
    if v is None or v <= 0:
        raise UserError(g.path, f"has no valid '{key}' in its metadata", "use a complete GGUF file")
    return v


def _softcap(g, arch: str) -> float | None:
    cap = metadata.value(g, f"{arch}.final_logit_softcapping", float)
    return float(f"{cap:.7g}") if cap else None


def _kv_heads(g, arch: str, layers: int, heads: int) -> list[int]:
    key = f"{arch}.attention.head_count_kv"
    if isinstance(g.get(key), list):
        kv = metadata.array(g, key, int)
    else:
        kv = [metadata.value(g, key, int, heads)] * layers
    if len(kv) < layers or any(k <= 0 or heads % k for k in kv[:layers]):
        raise UserError(g.path, f"has '{key}' = {kv}, not a divisor of its {heads} heads for "
                        f"each of its {layers} layers", _FIX)
    return list(kv[:layers])


def _kv_config(types: list[str], hd: int, hd_full: int, kv: list[int], k_eq_v: bool) -> dict:
    """The heads as Gemma4TextConfig reads them: ``num_key_value_heads`` (the sliding layers')
    and, where keys are values, ``num_global_key_value_heads`` (the full layers'); where the
    layers' KV heads follow no such rule, ``per_layer_config`` names each other layer's."""
    sliding = [k for k, t in zip(kv, types) if t == SLIDING] or [kv[-1]]
    full = [k for k, t in zip(kv, types) if t == FULL]
    nkv = sliding[0]
    if len(set(sliding)) == 1 and len(set(full)) == 1 and (k_eq_v or full[0] == nkv):
        return {"num_key_value_heads": nkv} | (
            {"num_global_key_value_heads": full[0]} if k_eq_v else {})
    per_layer = {}
    for i, (t, k) in enumerate(zip(types, kv)):
        size = hd_full if t == FULL else hd
        over = {"head_dim": size} if size != hd else {}
        over |= {"num_key_value_heads": k} if k != nkv else {}
        if over:
            per_layer[str(i)] = over
    return {"num_key_value_heads": nkv, "per_layer_config": per_layer}


def _rope(g, arch: str, hd_full: int, theta: float, scaling: dict | None) -> dict:
    """``rope_parameters`` per layer type: the sliding layers' default RoPE on their base; the
    full layers' from ``rope_freqs.weight`` (which pairs turn) and the linear factor: default,
    linear, or proportional with ``partial_rotary_factor`` (and ``factor``)."""
    local = metadata.value(g, f"{arch}.rope.freq_base_swa", float, 10000.0)
    if scaling is not None and scaling.get("rope_type") != "linear":
        raise UserError(g.path, f"has RoPE scaling {scaling.get('rope_type')!r}, which Gemma 4 "
                        "in llama.cpp does not carry", "use a GGUF file of another model")
    factor = {"factor": scaling["factor"]} if scaling else {}
    turning = _turning(g, hd_full)
    full = {"rope_theta": theta}
    if turning == hd_full // 2:
        full |= {"rope_type": "linear", **factor} if factor else {"rope_type": "default"}
    else:
        full |= {"rope_type": "proportional",
                 "partial_rotary_factor": _partial(turning, hd_full), **factor}
    return {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": float(f"{local:.7g}")}}


def _turning(g, hd_full: int) -> int:
    """How many full-layer frequency pairs turn (the leading ones whose ``rope_freqs`` is 1;
    the others' are :data:`STILL`). A header read without tensor data (model listing) gives
    all: only the shapes matter there, and import reads the file."""
    if ROPE_FREQS not in g.tensors or g.shape(ROPE_FREQS) != (hd_full // 2,):
        raise UserError(g.path, f"has no {ROPE_FREQS} of {hd_full // 2} numbers (one per "
                        "frequency pair of the full-attention layers)", _FIX)
    if not hasattr(g, "tensor"):
        return hd_full // 2
    f = np.asarray(g.tensor(ROPE_FREQS), np.float32).reshape(-1)
    turning = int(np.argmax(f != 1.0)) if (f != 1.0).any() else len(f)
    still = f[turning:]
    if not (still >= STILL / 10).all() or int(_partial(turning, hd_full) * hd_full // 2) != turning:
        raise UserError(g.path, f"has {ROPE_FREQS} other than the proportional RoPE's (ones for "
                        "the leading pairs, 1e30 for the others)", "import the model from its "
                        "Hugging Face folder instead")
    return turning


def _partial(turning: int, hd_full: int) -> float:
    """``partial_rotary_factor`` of ``turning`` of a full head's pairs."""
    return turning / (hd_full // 2)


def extra_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The tensor beside the model's own: ``rope_freqs.weight``."""
    return {ROPE_FREQS: (full_head_dim(spec) // 2,)}
