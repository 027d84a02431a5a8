"""Family <-> GGUF architecture, tensor names, and llama.cpp's Q/K row order.

Tensor names come from the ``gguf`` package's own map (``gguf.get_tensor_name_map``), queried
with the Hugging Face names of the engine's layouts, so no name table is kept here.

llama.cpp computes Llama-style RoPE on interleaved pairs (dims 2i, 2i+1) while Hugging Face
rotates halves (dims i, i + d/2). Its converter therefore reorders the rows of every head of
the q and k projections (weights and biases) of the ``llama`` architecture; Qwen2 and Qwen3 use
the "neox" (halves) RoPE in llama.cpp and are stored unchanged.
"""
from __future__ import annotations

import gguf
import numpy as np

from slideformer.engine.errors import UserError
from slideformer.engine.models.families import FAMILIES
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.models.weights import hf_name, item_layout, item_names

# Hugging Face model_type -> GGUF general.architecture (each family's ``gguf``). Mistral is
# "llama" in llama.cpp's converter; the family survives through general.name (transformers'
# loader reads it so).
ARCH = {mt: gguf.MODEL_ARCH[f.gguf.upper()] for mt, f in FAMILIES.items() if f.gguf}
GGUF_ARCHS = {gguf.MODEL_ARCH_NAMES[a]: a for a in ARCH.values()}
"""GGUF architecture name ("llama", "qwen2", "gemma3", ...) -> MODEL_ARCH."""
PERMUTED_ARCHS = ("llama",)


def arch_name(model_type: str) -> str:
    """The GGUF ``general.architecture`` of a Hugging Face family."""
    if model_type not in ARCH:
        raise UserError(f"model_type {model_type}", "has no GGUF conversion here yet",
                        f"GGUF import and export support {', '.join(ARCH)}; export the "
                        "Hugging Face folder and convert it with llama.cpp's convert_hf_to_gguf.py")
    return gguf.MODEL_ARCH_NAMES[ARCH[model_type]]


def model_type_of(arch: str) -> str:
    """The first family (in SUPPORTED order) stored as GGUF architecture ``arch``."""
    return next(mt for mt, a in ARCH.items() if gguf.MODEL_ARCH_NAMES[a] == arch)


def norm_shift(spec: ModelSpec, hf: str) -> float:
    """What llama.cpp's converter adds to tensor ``hf`` (Gemma's norms: weight - 1 is stored
    in Hugging Face checkpoints, the full scale in GGUF)."""
    return spec.family.norm_offset if hf.endswith("norm.weight") else 0.0


def tensor_names(spec: ModelSpec) -> dict[str, str]:
    """Hugging Face checkpoint name -> GGUF tensor name, for every tensor of ``spec``."""
    arch_name(spec.model_type)  # a family without a GGUF conversion: one clear message
    name_map = gguf.get_tensor_name_map(ARCH[spec.model_type], spec.num_layers)
    out = {}
    for item in item_names(spec):
        for local in item_layout(spec, item).names():
            hf = hf_name(item, local)
            base, suffix = hf.rsplit(".", 1)
            out[hf] = f"{name_map.get_name(base)}.{suffix}"
    if spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def qk_heads(spec: ModelSpec, hf: str) -> int | None:
    """Heads whose rows llama.cpp reorders in tensor ``hf`` (None: stored unchanged)."""
    if arch_name(spec.model_type) not in PERMUTED_ARCHS:
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
