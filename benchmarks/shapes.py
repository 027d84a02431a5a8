"""The model shapes every benchmark runs: one table, keyed by name.

Each entry is the published config.json values of a public model (or, where named so, a cut of
one that a host holds, or a small CPU stand-in); :func:`shape_config` completes it into a
config.json, :func:`shape_spec` into a ModelSpec. Weights are always random (benchmarks time
the maths, not the values).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slideformer.engine.models.spec import spec_from_config  # noqa: E402

SHAPES = {  # published config.json values of the public models
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, head_dim=64),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, head_dim=128),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False, head_dim=128),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                        tie_word_embeddings=False, head_dim=128),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          tie_word_embeddings=False, head_dim=128),
    "mistral-large-2": dict(hidden_size=12288, intermediate_size=28672, num_hidden_layers=88,
                            num_attention_heads=96, num_key_value_heads=8, vocab_size=32768,
                            tie_word_embeddings=False, head_dim=128),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False),
    # the same layers, 8 of them (5.6 B parameters): an MoE whose full fine-tune the host holds
    "qwen3-30b-a3b-8l": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                             norm_topk_prob=True, num_hidden_layers=8, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, vocab_size=151936,
                             tie_word_embeddings=False),
    # GPT-OSS (MXFP4 experts on disk; here random bf16/NF4): alternating window 128, sinks
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                        num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        vocab_size=201088, sliding_window=128, rope_theta=150000.0,
                        tie_word_embeddings=False),
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                         num_local_experts=128, num_experts_per_tok=4, num_hidden_layers=36,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         vocab_size=201088, sliding_window=128, rope_theta=150000.0,
                         tie_word_embeddings=False),
    # Qwen3.5 (hybrid: 3 gated DeltaNet layers of 4): transformers' Qwen3_5TextConfig and
    # Qwen3_5MoeTextConfig defaults (5.25; the MoE's are Qwen3.5-35B-A3B's published sizes);
    # the dense one cut to 16 layers (4.9 B parameters), a full fine-tune the host holds
    "qwen3.5-16l": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                        linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, vocab_size=248320, rope_theta=10000000.0,
                        partial_rotary_factor=0.25, tie_word_embeddings=False),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128,
                            linear_conv_kernel_dim=4, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, num_experts=256,
                            num_experts_per_tok=8, vocab_size=248320, rope_theta=10000000.0,
                            partial_rotary_factor=0.25, tie_word_embeddings=False),
    # OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924's config.json): 64 experts of 1024, top 8; a
    # mixture of experts whose full fine-tune the reference host holds (6.9 B parameters)
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                        vocab_size=50304, rope_theta=10000.0, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Gemma 4 31B (google/gemma-4-31B's text_config): 50 sliding layers (window 1024, 16 KV
    # heads of 256) and 10 full ones (4 KV heads of 512, keys as values, proportional RoPE)
    "gemma-4-31b": dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504,
                        num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16,
                        num_global_key_value_heads=4, head_dim=256, global_head_dim=512,
                        attention_k_eq_v=True, vocab_size=262144, sliding_window=1024,
                        final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                        num_kv_shared_layers=0, rms_norm_eps=1e-6,
                        hidden_activation="gelu_pytorch_tanh",
                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
                        tie_word_embeddings=True),
    "small-qwen3.5": dict(model_type="qwen3_5_text", hidden_size=256, intermediate_size=688,  # CPU
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=32, linear_value_head_dim=32,
                          linear_conv_kernel_dim=4, vocab_size=2048, partial_rotary_factor=0.25,
                          tie_word_embeddings=False),
    "small-gemma4": dict(model_type="gemma4_text", hidden_size=256, intermediate_size=688,  # CPU
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         num_global_key_value_heads=1, head_dim=64, global_head_dim=128,
                         attention_k_eq_v=True, vocab_size=2048, sliding_window=16,
                         final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                         layer_types=["sliding_attention"] * 5 + ["full_attention"],
                         tie_word_embeddings=True),
    "small-gpt-oss": dict(model_type="gpt_oss", hidden_size=256, intermediate_size=256,  # CPU
                          num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          vocab_size=2048, sliding_window=16, rope_theta=150000.0,
                          tie_word_embeddings=False),
    "small-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=688,  # CPU
                      moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=2048,
                      tie_word_embeddings=False),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,  # CPU timings
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                  tie_word_embeddings=False, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,  # CPU dry runs
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 tie_word_embeddings=True, head_dim=16),
}


def shape_config(name: str) -> dict:
    """A config.json of the model ``name`` (a key of SHAPES; Llama unless it names a family)."""
    return dict(dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                     max_position_embeddings=131072, torch_dtype="bfloat16"), **SHAPES[name])


def shape_spec(name: str):
    return spec_from_config(shape_config(name))
