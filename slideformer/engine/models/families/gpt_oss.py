"""GPT-OSS (``gpt_oss``: gpt-oss-20b, gpt-oss-120b): a mixture of experts with attention sinks.

What differs from Llama: biases on q, k, v and o; a learnt sink logit per attention head
(``self_attn.sinks``); sliding-window layers alternating with full ones (``layer_types``,
window 128 by default); YaRN RoPE; experts of their own kind (``Moe.gpt_oss``: a router with a
bias softmaxed over its top-k logits, gate and up interleaved in one projection, expert
biases, a clamped SwiGLU, tensors stored (E, in, out) and stacked on disk). The releases store
the experts in MXFP4 (``*_blocks`` + ``*_scales``): they are dequantised as they are read
(models.mxfp4); what the engine writes is bf16.

GptOssConfig's defaults are taken where config.json leaves a key out (``attention_bias`` true,
alternating layer types, window 128, the YaRN of the releases). With ``output_router_logits``
the router's load-balancing loss is trained, as for the other mixtures (models.moe.RouterAux).
"""
from pathlib import Path

from slideformer.engine.models.families.base import (FULL, SLIDING, Family, Moe, flag,
                                                     layer_types, rope_of, window)

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}
"""GptOssConfig's RoPE scaling when config.json names none (that of the releases)."""


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    types = layer_types(cfg, path, num_layers) or tuple(
        SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    if cfg.get("rope_scaling") is None and cfg.get("rope_parameters") is None:
        cfg = {**cfg, "rope_parameters": {**YARN, "rope_theta": cfg.get("rope_theta", 150000.0)}}
    theta, scaling = rope_of(cfg, path, default_theta=150000.0)
    bias = flag(cfg, "attention_bias", path, default=True)
    extra = {} if cfg.get("max_position_embeddings") is not None else \
        {"max_position_embeddings": 131072}
    return {"layer_types": types, "sliding_window": window(cfg, path) or 128,
            "rope_theta": theta, "rope_scaling": scaling, "qkv_bias": bias, "o_bias": bias,
            **extra}


FAMILY = Family(
    "gpt_oss", "GptOssForCausalLM", "GPT-OSS", configure=configure, sinks=True,
    moe=Moe("mlp.router.weight", "mlp.experts", "gate_up_proj", "gate_up_proj", "down_proj",
            ("num_local_experts", "num_experts"), "intermediate_size", renormalise=False,
            gpt_oss=True))
