"""Gemma 3 text (``gemma3_text``: the text-only checkpoints, Gemma 3 270M and 1B; and the text
tower of the multimodal ``gemma3`` folders, 4B, 12B and 27B: :func:`text_tower`).

Sandwich norms (before and after attention and MLP), norms that scale by (1 + weight), per-head
q/k norms, GeGLU (tanh-approximated GELU), the embedding scaled by sqrt(hidden_size), scores
scaled by ``query_pre_attn_scalar`` ** -0.5, and local sliding-window layers (every
``sliding_window_pattern``-th layer full, the others windowed) with a RoPE base of their own.
Logit soft-capping (Gemma 2's) and bidirectional attention are refused.
"""
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.models.families.base import (FIX, FULL, SLIDING, Family, layer_types,
                                                     positive_int, positive_real, rope_per_type,
                                                     window)

TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                 "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                 "query_pre_attn_scalar": 256, "sliding_window": 4096,
                 "tie_word_embeddings": True}
"""Gemma3TextConfig's defaults (transformers 5.25): the released multimodal configs write only
what differs from them (4B: sizes, layers, window and RoPE scaling; heads and head_dim not)."""


def text_tower(cfg: dict, path: Path) -> dict:
    """The config.json of a multimodal Gemma 3 folder (``model_type`` "gemma3") as its text
    tower's: ``text_config`` over :data:`TEXT_DEFAULTS`, the folder's dtype and tying where it
    gives none (its ``tie_word_embeddings`` decides, as in transformers), as a text-only
    ``gemma3_text`` config (what an export writes: the tuned folder is
    a Gemma3ForCausalLM; the vision tower and its projector are neither trained nor written).
    Its weights are read under the tower's prefix (models.weights.Checkpoint)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UserError(path, "is a multimodal Gemma 3 config.json without a 'text_config' object",
                        FIX)
    out = {**TEXT_DEFAULTS, **text}
    for key in ("torch_dtype", "dtype"):
        if key not in text and key in cfg:
            out[key] = cfg[key]
    if "tie_word_embeddings" in cfg:  # the multimodal model's own setting decides its head
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return out | {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}


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
