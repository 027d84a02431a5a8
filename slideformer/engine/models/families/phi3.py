"""Phi-3 and Phi-4 (``phi3``): Llama's layer with q, k, v in one projection (``qkv_proj``) and
gate, up in another (``gate_up_proj``); a set ``sliding_window`` windows every layer. Partial
rotary embeddings (``partial_rotary_factor`` < 1, Phi-4-mini) and LongRoPE scaling are refused."""
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.models.families.base import FIX, Family
from slideformer.engine.models.families.mistral import configure as windows


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = cfg.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise UserError(path, f"sets partial_rotary_factor = {factor!r}: RoPE on part of each "
                        "head, which this engine does not compute", FIX + " (or use another tool)")
    return windows(cfg, path, num_layers)


FAMILY = Family("phi3", "Phi3ForCausalLM", "Phi-3", fused=True, configure=configure)
