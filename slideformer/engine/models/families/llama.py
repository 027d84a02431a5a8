"""Llama 2 and 3.x (``llama``): the base layer every other family is described against.

Pre-norm RMSNorm, grouped-query attention with RoPE (plain, linear or llama3 scaling), SwiGLU MLP.
"""
from slideformer.engine.models.families.base import Family

FAMILY = Family("llama", "LlamaForCausalLM", "Llama", gguf="llama")
