"""Qwen3.5 (``qwen3_5_text``; the text tower of the multimodal ``qwen3_5`` folders: :func:`text_tower`).

A hybrid: ``layer_types`` marks each layer "linear_attention" (gated DeltaNet,
slideformer.engine.models.deltanet; three of every four by default, ``full_attention_interval``)
or "full_attention": Qwen3's attention with an output gate (``q_proj`` gives each head's
[query | gate], the output is multiplied by sigmoid(gate)) and RoPE on the first
``partial_rotary_factor`` of each head only. Every norm, q/k norms included, scales by
(1 + weight) as Gemma's do; the DeltaNet's gated output norm scales by its weight.
Text-only positions are the same in the three sections of Qwen3.5's multimodal RoPE, which is
then plain RoPE on the rotated dimensions (transformers' interleaved sections pick frequencies
of one table).
"""
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.models.families.base import (FIX, FULL, LINEAR, DeltaNetShape, Family,
                                                     layer_types, positive_int, positive_real,
                                                     rotary_dims)


def text_tower(cfg: dict, path: Path, text_type: str = "qwen3_5_text") -> dict:
    """The config.json of a multimodal Qwen3.5 folder as its text model's: ``text_config``
    with the folder's dtype and tying where it gives none; the weights are read under the
    tower's prefix (models.weights.TOWER_PREFIXES); the vision tower is neither trained nor
    written."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UserError(path, "is a multimodal Qwen3.5 config.json without a 'text_config' "
                        "object", FIX)
    out = dict(text)
    for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
        if key not in text and key in cfg:
            out[key] = cfg[key]
    cls = "Qwen3_5MoeForCausalLM" if text_type == "qwen3_5_moe_text" else "Qwen3_5ForCausalLM"
    return out | {"model_type": text_type, "architectures": [cls]}


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    types = layer_types(cfg, path, num_layers, known=(FULL, LINEAR))
    if types is None:  # Qwen3_5TextConfig's rule
        every = positive_int(cfg, "full_attention_interval", path) \
            if cfg.get("full_attention_interval") is not None else 4
        types = tuple(LINEAR if (i + 1) % every else FULL for i in range(num_layers))
    hd = positive_int(cfg, "head_dim", path) if cfg.get("head_dim") is not None else \
        positive_int(cfg, "hidden_size", path) // positive_int(cfg, "num_attention_heads", path)
    linear = None
    if LINEAR in types:
        linear = DeltaNetShape(
            *(positive_int(cfg, k, path, 1 << 12) for k in (
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim")),
            eps=positive_real(cfg, "rms_norm_eps", path, 1e-6, below=1.0))
        if linear.num_v_heads % linear.num_k_heads:
            raise UserError(path, f"linear_num_value_heads={linear.num_v_heads} is not a "
                            f"multiple of linear_num_key_heads={linear.num_k_heads}", FIX)
    return {"layer_types": types, "rotary_dim": rotary_dims(cfg, path, hd, 0.25), "linear": linear}


FAMILY = Family(
    "qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3.5", qk_norm="head", norm_offset=1.0,
    attn_gate=True, linear=True, configure=configure, gguf="qwen35")
