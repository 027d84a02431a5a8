"""Qwen3.5-MoE (``qwen3_5_moe_text``; the text tower of the multimodal ``qwen3_5_moe`` folders).

Qwen3.5's hybrid layers (qwen3_5.py) with a mixture of experts in every layer: softmax router
``mlp.gate``, top-k renormalised, and a shared expert every token goes through, scaled by
sigmoid(``mlp.shared_expert_gate``).
"""
from pathlib import Path

from slideformer.engine.models.families import qwen3_5
from slideformer.engine.models.families.base import Family, Moe


def text_tower(cfg: dict, path: Path) -> dict:
    return qwen3_5.text_tower(cfg, path, "qwen3_5_moe_text")


FAMILY = Family(
    "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3.5-MoE", qk_norm="head", norm_offset=1.0,
    attn_gate=True, linear=True, configure=qwen3_5.configure,
    moe=Moe("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj",
            ("num_experts",), "moe_intermediate_size", renormalise=True,
            shared="mlp.shared_expert"), gguf="qwen35moe")
