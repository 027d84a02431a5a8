"""SmolLM3 (``smollm3``): Llama's layer; every ``no_rope_layer_interval``-th layer has no RoPE
(NoPE), per ``no_rope_layers`` (1: the layer rotates, 0: it does not)."""
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.models.families.base import (FIX, FULL, SLIDING, Family, flag, layer_types,
                                                     positive_int)


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    nope = cfg.get("no_rope_layers")
    if nope is None:
        every = positive_int(cfg, "no_rope_layer_interval", path) \
            if cfg.get("no_rope_layer_interval") is not None else 4
        nope = [int((i + 1) % every != 0) for i in range(num_layers)]
    if (not isinstance(nope, list) or len(nope) != num_layers
            or any(v not in (0, 1) or isinstance(v, bool) for v in nope)):
        raise UserError(path, f"'no_rope_layers' is {nope!r}, not a list of {num_layers} "
                        "values 0 or 1 (one per layer)", FIX)
    types = layer_types(cfg, path, num_layers)
    if types is None:
        windowed = flag(cfg, "use_sliding_window", path) and cfg.get("sliding_window")
        types = tuple(SLIDING if windowed and not r else FULL for r in nope)
    elif not flag(cfg, "use_sliding_window", path):
        types = (FULL,) * num_layers
    return {"layer_types": types, "rope_layers": tuple(bool(r) for r in nope)}


FAMILY = Family("smollm3", "SmolLM3ForCausalLM", "SmolLM3", configure=configure,
                gguf="smollm3")
