"""Phi-3 and Phi-4 (``phi3``): Llama's layer with q, k, v in one projection (``qkv_proj``) and
gate, up in another (``gate_up_proj``); a set ``sliding_window`` windows every layer. RoPE may
turn only the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75) and be scaled
by LongRoPE (``rope_scaling`` of type "longrope", or "su" as early releases name it):
families.base._longrope, models.layers.rope_tables. transformers' Phi3Config reads a "yarn"
type as LongRoPE too: such a config is refused rather than computed either way."""
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.models.families.base import Family, positive_int, rope_of, rotary_dims
from slideformer.engine.models.families.mistral import configure as windows


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    hd = positive_int(cfg, "head_dim", path) if cfg.get("head_dim") is not None else \
        positive_int(cfg, "hidden_size", path) // positive_int(cfg, "num_attention_heads", path)
    for key in ("rope_scaling", "rope_parameters"):
        rs = cfg.get(key)
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "yarn":
            raise UserError(path, f"{key} of a Phi-3 model has type 'yarn', which transformers "
                            "reads as LongRoPE and other tools as YaRN", "name the type 'longrope' "
                            "(with short_factor and long_factor), as Phi-3 releases do")
    out = dict(windows(cfg, path, num_layers), rotary_dim=rotary_dims(cfg, path, hd))
    rs = rope_of(cfg, path)[1]
    if dict(rs or ()).get("rope_type") == "longrope":  # Phi3Config's original context: 4096
        out["rope_scaling"] = rope_of({"original_max_position_embeddings": 4096, **cfg}, path)[1]
    return out


FAMILY = Family("phi3", "Phi3ForCausalLM", "Phi-3", fused=True, configure=configure,
                gguf="phi3")
