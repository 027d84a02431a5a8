"""Mixtral (``mixtral``): Mistral's attention, a mixture of experts as its feed-forward.

Router ``block_sparse_moe.gate`` (softmax, top-k, renormalised); experts w1 (gate), w3 (up),
w2 (down). The training-time router jitter is random noise transformers adds to the hidden
states: refused rather than reproduced.
"""
from slideformer.engine.models.families.base import Family, Moe
from slideformer.engine.models.families.mistral import configure

FAMILY = Family(
    "mixtral", "MixtralForCausalLM", "Mixtral", configure=configure,
    moe=Moe("block_sparse_moe.gate.weight", "block_sparse_moe.experts", "w1", "w3", "w2",
            ("num_local_experts", "num_experts"), "intermediate_size", renormalise=True),
    refuse=(("router_jitter_noise", 0.0),), gguf="llama")
