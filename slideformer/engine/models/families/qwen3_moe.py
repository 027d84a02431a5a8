"""Qwen3-MoE (``qwen3_moe``: Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, experts as feed-forward.

Router ``mlp.gate`` (softmax, top-k, renormalised when ``norm_topk_prob``). A layer's
feed-forward is the experts unless ``mlp_only_layers`` lists it or ``decoder_sparse_step`` skips
it (every ``decoder_sparse_step``-th layer is sparse, as transformers decides); the others are a
dense gated MLP of ``intermediate_size`` (layers of two shapes: ModelSpec.sparse).
"""
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.models.families import qwen2
from slideformer.engine.models.families.base import FIX, Family, Moe, positive_int


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense):
        raise UserError(path, f"'mlp_only_layers' is {dense!r}, not a list of layer numbers "
                        f"from 0 to {num_layers - 1}", FIX)
    step = positive_int(cfg, "decoder_sparse_step", path) \
        if cfg.get("decoder_sparse_step") is not None else 1
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not any(sparse):
        raise UserError(path, "'mlp_only_layers' and 'decoder_sparse_step' leave no layer with "
                        "experts", FIX)
    return {**qwen2.configure(cfg, path, num_layers), "sparse": () if all(sparse) else sparse}


FAMILY = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", qk_norm="head", configure=configure,
    moe=Moe("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj",
            ("num_experts", "num_local_experts"), "moe_intermediate_size", renormalise="norm_topk_prob"),
    gguf="qwen3moe")
