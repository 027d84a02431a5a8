"""Mistral (``mistral``): Llama's layer; ``sliding_window`` makes every layer windowed."""
from pathlib import Path

from slideformer.engine.models.families.base import FULL, SLIDING, Family, all_layers, window


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    """A set ``sliding_window`` windows every layer (transformers' Mistral and Mixtral read no
    ``layer_types``)."""
    return {"layer_types": all_layers(SLIDING if window(cfg, path) else FULL, num_layers)}


FAMILY = Family("mistral", "MistralForCausalLM", "Mistral", configure=configure,
                gguf="llama")
