"""Qwen2 and Qwen2.5 (``qwen2``): Llama's layer with biases on q, k and v.

``use_sliding_window`` windows the layers from ``max_window_layers`` on.
"""
from pathlib import Path

from slideformer.engine.models.families.base import FULL, SLIDING, Family, count, flag, layer_types


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    """The layer types of a Qwen config (its ``layer_types`` when written, else
    ``use_sliding_window`` with ``max_window_layers``, as transformers derives them)."""
    types = layer_types(cfg, path, num_layers)
    if types is None:
        first = num_layers
        if flag(cfg, "use_sliding_window", path) and cfg.get("sliding_window"):
            first = (num_layers if cfg.get("max_window_layers") is None
                     else count(cfg, "max_window_layers", path))
        types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    elif not flag(cfg, "use_sliding_window", path):
        types = (FULL,) * num_layers  # transformers windows none while the switch is off
    return {"layer_types": types}


FAMILY = Family("qwen2", "Qwen2ForCausalLM", "Qwen2", qkv_bias=True, configure=configure,
                gguf="qwen2")
