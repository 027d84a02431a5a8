"""Tiny random models of every supported family, generated locally (no network needed).

A tiny model is a complete Hugging Face folder: config.json, model.safetensors (seeded random
init), a byte-level BPE tokenizer trained on text generated here with the special tokens of the
family's real tokenizer (:data:`FAMILY_TOKENS`), and tokenizer_config.json with a chat template.
It is the demo's default model and the tests' fixture.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from slideformer.engine.models.spec import FAMILIES, SUPPORTED, spec_from_config
from slideformer.engine.models.weights import item_names, stored_shapes, write_hf_folder

BOS, EOS, PAD, IM_START = "<|begin_of_text|>", "<|im_end|>", "<|pad|>", "<|im_start|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""The llama tiny model's ChatML template, after its bos token."""
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ m['content'] }}{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}"
    "{% endfor %}")


@dataclass(frozen=True)
class FamilyTokens:
    """The special tokens of a family's real tokenizer, which its tiny tokenizer copies (so
    transformers' tokenizer class for the family finds every token it expects in the vocab)."""

    specials: tuple[str, ...]
    """Every special token, in id order (ids 0 .. n-1)."""
    bos: str | None
    """Prepended to every text; None: the family adds none (Qwen)."""
    eos: str
    """Ends an assistant turn."""
    pad: str
    chat_template: str
    split: str | None = None
    """The regex the family's tokenizer splits text with before byte-level BPE (None: the
    byte-level default)."""


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen2's pre-tokenizer pattern (its tokenizer.json and transformers' Qwen2Tokenizer split
with it: digits one by one)."""

FAMILY_TOKENS = {
    "llama": FamilyTokens((BOS, EOS, PAD, IM_START), BOS, EOS, PAD, CHAT_TEMPLATE),
    "mistral": FamilyTokens(("<unk>", "<s>", "</s>"), "<s>", "</s>", "<unk>", MISTRAL_TEMPLATE),
    "qwen2": FamilyTokens(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                          "<|endoftext|>", CHAT_TEMPLATE.removeprefix("{{ bos_token }}"),
                          QWEN_SPLIT),
}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma's turn format (its real template also folds a system message into the first user turn)."""
FAMILY_TOKENS["gemma3_text"] = FamilyTokens(
    ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"), "<bos>",
    "<end_of_turn>", "<pad>", GEMMA_TEMPLATE)
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
"""Gemma 4's turns (its real template adds thinking, tools and a system turn of its own)."""
FAMILY_TOKENS["gemma4_text"] = FamilyTokens(
    ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"), "<bos>", "<turn|>",
    "<pad>", GEMMA4_TEMPLATE)
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}"
    "{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m['content'] }}"
    "{{ '<|return|>' if m['role'] == 'assistant' else '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
"""GPT-OSS's harmony turns, cut down (the real template adds the system preamble, channels
for reasoning and tools, and ends earlier replies with <|end|>)."""
FAMILY_TOKENS["gpt_oss"] = FamilyTokens(
    ("<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>"), None,
    "<|return|>", "<|endoftext|>", HARMONY_TEMPLATE)
for _a, _b in (("qwen3", "qwen2"), ("qwen3_moe", "qwen2"), ("qwen3_5_text", "qwen2"),
               ("qwen3_5_moe_text", "qwen2"),
               ("mixtral", "mistral"),
               ("olmo2", "llama"), ("olmo3", "llama"), ("olmoe", "llama"), ("smollm3", "llama"),
               ("phi3", "llama")):
    FAMILY_TOKENS[_a] = FAMILY_TOKENS[_b]

_WORDS = ("the a model layer train token data learn small large fast slow reverse number sum "
          "answer question user assistant system write read one two three four five six seven "
          "eight nine ten word text string letter digit add plus minus equal result please what "
          "is of to and in for with on by from this that it be are was".split())


def synthetic_corpus(n_lines: int, seed: int = 0) -> list[str]:
    """Deterministic English-like lines with words, digits and arithmetic, for tokenizer training."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{words.capitalize()}. {a} + {b} = {a + b}. {words[::-1]}")
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0,
                    tokens: FamilyTokens = FAMILY_TOKENS["llama"]) -> Tokenizer:
    """A byte-level BPE tokenizer with a family's special tokens; its bos (if any) is added to
    every text, like Llama 3's."""
    tok = Tokenizer(models.BPE())
    if tokens.split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(tokens.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(tokens.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(synthetic_corpus(4000, seed), trainer=trainer)
    bos = tokens.bos
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


@dataclass(frozen=True)
class TinyShape:
    """Sizes of a tiny model; the defaults are odd on purpose (catch shape bugs)."""

    layers: int = 4
    hidden: int = 96
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 160
    vocab: int = 384
    head_dim: int | None = None
    tie: bool = False
    max_positions: int = 2048


def tiny_config(arch: str, shape: TinyShape, tok: Tokenizer | None = None) -> dict:
    """A config.json dict for a tiny model of family ``arch``: every layer type of the family
    present in 4 layers (sliding and full layers, a NoPE layer, experts routed top-2 of 4)."""
    if arch not in SUPPORTED:
        raise ValueError(f"arch must be one of {SUPPORTED}")
    cfg = {"architectures": [FAMILIES[arch].hf_class], "model_type": arch,
           "vocab_size": shape.vocab,
           "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
           "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
           "num_key_value_heads": shape.kv_heads, "hidden_act": "silu",
           "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "tie_word_embeddings": shape.tie, "torch_dtype": "float32",
           "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}
    if shape.head_dim:
        cfg["head_dim"] = shape.head_dim
    hd = shape.head_dim or shape.hidden // shape.heads
    if arch in ("llama", "olmo2", "olmo3", "smollm3"):
        cfg.update(attention_bias=False, mlp_bias=False)
    if arch == "olmoe":  # OlmoeConfig's routing: top-k weights as the softmax gave them
        cfg.update(attention_bias=False, num_experts=4, num_experts_per_tok=2,
                   intermediate_size=shape.intermediate // 2, norm_topk_prob=False,
                   output_router_logits=False, clip_qkv=None)
    if arch in ("mistral", "mixtral", "phi3"):
        cfg["sliding_window"] = None
    if arch in ("qwen2", "qwen3", "qwen3_moe", "smollm3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.layers)
    if arch in ("qwen3", "qwen3_moe"):
        cfg.update(attention_bias=False, head_dim=hd)
    if arch == "mixtral":
        cfg.update(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                   output_router_logits=False, intermediate_size=shape.intermediate // 2)
    if arch == "qwen3_moe":
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=shape.intermediate // 2,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                   output_router_logits=False)
    if arch == "olmo3":  # three sliding layers of four, as Olmo3Config's default pattern
        cfg.update(sliding_window=8, layer_types=["sliding_attention" if (i + 1) % 4 else
                                                  "full_attention" for i in range(shape.layers)])
    if arch == "smollm3":
        cfg["no_rope_layer_interval"] = 4  # layer 3 of 4 has no RoPE
    if arch == "gemma3_text":
        del cfg["hidden_act"]
        types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(shape.layers)]
        cfg.update(hidden_activation="gelu_pytorch_tanh", head_dim=hd, attention_bias=False,
                   query_pre_attn_scalar=hd + 8, sliding_window=8, layer_types=types,
                   rope_theta=1e6, rope_local_base_freq=1e4, final_logit_softcapping=None,
                   attn_logit_softcapping=None)
    if arch == "gemma4_text":  # full layers with heads of their own, keys as values; window 8
        del cfg["hidden_act"], cfg["rope_theta"]
        cfg.update(hidden_activation="gelu_pytorch_tanh", head_dim=hd, global_head_dim=2 * hd,
                   num_global_key_value_heads=1, attention_k_eq_v=True, attention_bias=False,
                   sliding_window=8, layer_types=["sliding_attention" if i % 2 == 0 else
                                                 "full_attention" for i in range(shape.layers)],
                   # the tiny logits are ~0.2: a cap of 30 (the releases') would leave them
                   # straight, 0.5 bends them
                   final_logit_softcapping=0.5, hidden_size_per_layer_input=0,
                   vocab_size_per_layer_input=shape.vocab, num_kv_shared_layers=0,
                   use_double_wide_mlp=False, use_bidirectional_attention=None,
                   # experts top-2 of 4 when a variant sets enable_moe_block
                   enable_moe_block=False, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=shape.intermediate // 2)
    if arch == "gpt_oss":  # experts top-2 of 4, biases; window 8; YaRN x4
        cfg.update(num_local_experts=4, num_experts_per_tok=2, head_dim=hd, attention_bias=True,
                   intermediate_size=shape.intermediate // 2, sliding_window=8,
                   layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(shape.layers)],
                   output_router_logits=False, swiglu_alpha=1.702, swiglu_limit=7.0,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                    "original_max_position_embeddings": shape.max_positions // 4})
        del cfg["rope_theta"]
    if arch == "qwen3_5_moe_text":  # experts top-2 of 4 and a shared expert
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=shape.intermediate // 2,
                   shared_expert_intermediate_size=shape.intermediate // 4,
                   output_router_logits=False)
    if arch in ("qwen3_5_text", "qwen3_5_moe_text"):  # three gated DeltaNet layers of four; RoPE on a quarter of a head
        cfg.update(head_dim=hd, attention_bias=False, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=12,
                   linear_conv_kernel_dim=4,
                   layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                for i in range(shape.layers)],
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                    "mrope_section": [hd // 8 - hd // 16, hd // 16, 0]})
        del cfg["rope_theta"]
    if tok is not None:
        t = FAMILY_TOKENS[arch]
        cfg.update(bos_token_id=tok.token_to_id(t.bos) if t.bos else None,
                   eos_token_id=tok.token_to_id(t.eos), pad_token_id=tok.token_to_id(t.pad))
    return cfg


SCALES = re.compile(r"(norm(_\d+)?\.weight|layer_scalar|router\.scale|router\.per_expert_scale)$")
"""Tensors that scale by their values (norms, Gemma 4's layer and router scales): drawn near 1."""


def unit_value(spec, name: str) -> float | None:
    """Where a tensor scales by its values (``SCALES``), the value at which it leaves its input
    unchanged, as a model's initialisation sets it: one, or zero for the norms of a family that
    scales by 1 + w (Gemma 3, Qwen3.5; ``Family.norm_offset``) but one for DeltaNet's gated norm,
    which scales by its weight; None for every other tensor."""
    if not SCALES.search(name):
        return None
    if re.search(r"(^|\.)linear_attn\.", name) or not re.search(r"norm(_\d+)?\.weight$", name):
        return 1.0
    return 1.0 - spec.family.norm_offset


def random_tensors(spec, seed: int):
    """Seeded random weights: N(0, 0.02) matrices, norms and scales near 1, small biases."""
    g = torch.Generator().manual_seed(seed)
    for item in item_names(spec):
        for name, shape in stored_shapes(spec, item):
            one = unit_value(spec, name)
            if one is not None:
                t = one + 0.1 * torch.randn(shape, generator=g)
            else:
                t = 0.02 * torch.randn(shape, generator=g)
            yield name, t


def make_tiny_model(out: Path | str, arch: str = "llama", shape: TinyShape = TinyShape(),
                    seed: int = 0, extra_config: dict | None = None) -> Path:
    """Create a complete tiny Hugging Face model folder at ``out`` and return its path.

    Args:
        extra_config: config.json keys set over the tiny config before the weights are drawn
            (e.g. ``rope_scaling``, ``attention_bias``), for variants TinyShape does not cover.
    """
    out = Path(out)
    tokens = FAMILY_TOKENS[arch]
    tok = train_tokenizer(shape.vocab, seed, tokens)
    cfg = tiny_config(arch, shape, tok) | (extra_config or {})
    spec = spec_from_config(cfg)
    staging = out.with_name(out.name + ".tok")
    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    (staging / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokens.bos,
        "eos_token": tokens.eos, "pad_token": tokens.pad, "chat_template": tokens.chat_template,
        "model_max_length": shape.max_positions, "add_bos_token": tokens.bos is not None},
        indent=2))
    write_hf_folder(out, spec, random_tensors(spec, seed), dtype=torch.float32,
                    tokenizer_dir=staging)
    for f in staging.iterdir():
        f.unlink()
    staging.rmdir()
    return out
