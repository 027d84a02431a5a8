"""The supported model families, one file each: ``FAMILIES[model_type]`` is its :class:`Family`.

Where is Gemma? ``gemma3.py`` and ``gemma4.py``. GPT-OSS? ``gpt_oss.py``. Qwen3.5?
``qwen3_5.py``. OLMoE? ``olmoe.py``. What a family may declare: ``base.py``.
"""
from slideformer.engine.models.families import (gemma3, gemma4, gpt_oss, llama, mistral, mixtral,
                                                olmo2, olmo3, olmoe, phi3, qwen2, qwen3, qwen3_5,
                                                qwen3_5_moe, qwen3_moe, smollm3)
from slideformer.engine.models.families.base import Family

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in (
    llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, olmo2, olmo3, olmoe, phi3, smollm3, gemma3,
    gemma4, gpt_oss, qwen3_5, qwen3_5_moe)}
SUPPORTED = tuple(FAMILIES)
"""Hugging Face ``model_type`` values this engine trains."""
TEXT_TOWERS = {"gemma3": gemma3.text_tower, "gemma4": gemma4.text_tower,
               "qwen3_5": qwen3_5.text_tower, "qwen3_5_moe": qwen3_5_moe.text_tower}
"""Multimodal ``model_type`` values whose text tower is one of the families: ``text_tower(cfg,
path)`` gives that family's config.json."""
