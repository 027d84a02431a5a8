"""OLMo 3 (``olmo3``): OLMo 2's layer, with sliding-window layers (by default three of every
four; ``layer_types``) whose RoPE is their own (``rope_parameters`` per layer type; the full
layers' may be scaled)."""
from pathlib import Path

from slideformer.engine.models.families.base import (FULL, SLIDING, Family, layer_types,
                                                     rope_per_type, window)


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    types = layer_types(cfg, path, num_layers)
    if types is None:  # Olmo3Config's default
        types = tuple(SLIDING if (i + 1) % 4 else FULL for i in range(num_layers))
    # a flat rope_theta is the full layers' base; the sliding layers keep Olmo3Config's default
    # (5e5) unless rope_parameters names theirs, as transformers reads it
    return {"layer_types": types, **rope_per_type(cfg, path, 5e5, 5e5),
            "sliding_window": window(cfg, path) or 4096}  # Olmo3Config's default window


FAMILY = Family("olmo3", "Olmo3ForCausalLM", "OLMo 3", norm="post", qk_norm="full",
                configure=configure, gguf="olmo2")
