"""Qwen3 (``qwen3``): Llama's layer with a per-head RMSNorm on q and k (no q/k/v biases)."""
from slideformer.engine.models.families.base import Family
from slideformer.engine.models.families.qwen2 import configure

FAMILY = Family("qwen3", "Qwen3ForCausalLM", "Qwen3", qk_norm="head", configure=configure,
                gguf="qwen3")
