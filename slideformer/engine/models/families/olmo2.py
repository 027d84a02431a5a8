"""OLMo 2 (``olmo2``): norms on the outputs of attention and MLP (no pre-norm), and one RMSNorm
over all heads of q and of k, before they split into heads."""
from slideformer.engine.models.families.base import Family

FAMILY = Family("olmo2", "Olmo2ForCausalLM", "OLMo 2", norm="post", qk_norm="full",
                gguf="olmo2")
