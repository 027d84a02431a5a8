"""Qwen3-MoE (``qwen3_moe``: Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, experts in every layer.

Router ``mlp.gate`` (softmax, top-k, renormalised when ``norm_topk_prob``). Dense layers among
the sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` > 1) would give layers of two
shapes, which this engine's uniform layer slots do not hold yet: refused.
"""
from slideformer.engine.models.families.base import Family, Moe
from slideformer.engine.models.families.qwen2 import configure

FAMILY = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", qk_norm="head", configure=configure,
    moe=Moe("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj",
            ("num_experts", "num_local_experts"), "moe_intermediate_size", renormalise="norm_topk_prob"),
    refuse=(("mlp_only_layers", []), ("decoder_sparse_step", 1)),
    gguf="qwen3moe")
