"""Gemma 3 text (``gemma3_text``: the text-only checkpoints, Gemma 3 270M and 1B; the
multimodal ``gemma3`` configs of 4B and up nest this one under ``text_config`` and are not read).

Sandwich norms (before and after attention and MLP), norms that scale by (1 + weight), per-head
q/k norms, GeGLU (tanh-approximated GELU), the embedding scaled by sqrt(hidden_size), scores
scaled by ``query_pre_attn_scalar`` ** -0.5, and local sliding-window layers (every
``sliding_window_pattern``-th layer full, the others windowed) with a RoPE base of their own.
Logit soft-capping (Gemma 2's) and bidirectional attention are refused.
"""
from pathlib import Path

from slideformer.engine.models.families.base import (FULL, SLIDING, Family, layer_types,
                                                     positive_int, positive_real, rope_per_type,
                                                     window)


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    types = layer_types(cfg, path, num_layers)
    if types is None:
        every = positive_int(cfg, "sliding_window_pattern", path) \
            if cfg.get("sliding_window_pattern") is not None else 6
        types = tuple(SLIDING if (i + 1) % every else FULL for i in range(num_layers))
    scalar = positive_real(cfg, "query_pre_attn_scalar", path, 256.0)
    return {"layer_types": types, **rope_per_type(cfg, path, 1e6, 1e4), "attn_scale": scalar ** -0.5,
            "sliding_window": window(cfg, path) or 4096}  # Gemma3TextConfig's default


CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.first and system %}{{ system }}\n\n{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma's turns (``<start_of_turn>user`` / ``model``, a system message folded into the first
user turn), for GGUF files that carry no template."""

FAMILY = Family(
    "gemma3_text", "Gemma3ForCausalLM", "Gemma 3", norm="sandwich", qk_norm="head",
    norm_offset=1.0, embed_scale=True, act="gelu_tanh", configure=configure,
    refuse=(("final_logit_softcapping", None), ("attn_logit_softcapping", None),
            ("use_bidirectional_attention", False)),
    gguf="gemma3", chat_template=CHAT_TEMPLATE)
