"""OLMoE (``olmoe``: OLMoE-1B-7B): Llama's pre-norm layer with OLMo's q/k norms (one RMSNorm over
all heads of q and of k, before they split into heads) and experts as the feed-forward: router
``mlp.gate`` (softmax, top-k, renormalised only when ``norm_topk_prob``, false in OlmoeConfig),
experts of ``intermediate_size``, stored per expert as Qwen3-MoE's. The load-balancing loss is
OlmoeConfig's (``router_aux_loss_coef`` 0.01 while ``output_router_logits``). ``clip_qkv``
(clamping q, k and v) is refused: the released models leave it null."""
from slideformer.engine.models.families.base import Family, Moe

FAMILY = Family(
    "olmoe", "OlmoeForCausalLM", "OLMoE", qk_norm="full", refuse=(("clip_qkv", None),),
    moe=Moe("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj",
            ("num_experts", "num_local_experts"), "intermediate_size",
            renormalise="norm_topk_prob", aux_default=0.01), gguf="olmoe")
