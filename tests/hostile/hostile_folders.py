"""Hostile corpus, category model folders: the cases model-folder fuzzing (folder_fuzz.py) found
mishandled, kept as fixed cases: config.json windows and RoPE types of the wrong type, index files
naming what is not a shard, tokenizers whose special tokens do not survive encoding, templates that
render no reply, safetensors headers that lie. ``CORPUS`` is every category of the corpus.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from folder_fuzz import (DELETE, Breakage, config_breakage, header_breakage, index_breakage,
                         jinja_breakage, length_breakage, tensor_breakage,
                         tokenizer_config_breakage, tokenizer_json_breakage, truncated)
from hostile_corpus import CATEGORIES, Case, plan, setkey, train, write
from hostile_adapters import ADAPTER_FOLDERS
from hostile_gguf import GGUF_FILES

INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"


def broken(*changes: Breakage) -> Callable[[Path], None]:
    """Prepare a case by breaking the work folder's model."""
    def prepare(w: Path) -> None:
        for b in changes:
            b.change(w / "model")
    return prepare


def cfg(**changes) -> Callable[[Path], None]:
    return broken(config_breakage(changes))


MODEL_FOLDERS = [
    Case("sliding_window 'abc'", plan(), ("config.json", "sliding_window"),
         cfg(model_type="mistral", sliding_window="abc")),
    Case("sliding_window a list", plan(), ("config.json", "sliding_window"),
         cfg(model_type="mistral", sliding_window=[4096])),
    Case("sliding_window negative", plan(), ("config.json", "sliding_window"),
         cfg(model_type="mistral", sliding_window=-5)),
    Case("sliding_window 1.5", plan(), ("config.json", "sliding_window"),
         cfg(model_type="mistral", sliding_window=1.5)),
    Case("max_window_layers 'x'", plan(), ("config.json", "max_window_layers"),
         cfg(model_type="qwen2", sliding_window=16, use_sliding_window=True,
             max_window_layers="x")),
    Case("use_sliding_window 'yes'", plan(), ("config.json", "use_sliding_window"),
         cfg(model_type="qwen2", sliding_window=16, use_sliding_window="yes")),
    Case("layer_types a string", plan(), ("config.json", "layer_types"),
         cfg(model_type="qwen2", use_sliding_window=True, sliding_window=16,
             layer_types="sliding_attention")),
    Case("layer_types of numbers", plan(), ("config.json", "layer_types"),
         cfg(model_type="qwen2", use_sliding_window=True, sliding_window=16,
             layer_types=[1, 2])),
    # ---- mixture-of-experts and per-layer configs that contradict themselves
    Case("more experts per token than experts", plan(), ("config.json", "num_experts_per_tok"),
         cfg(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=8,
             moe_intermediate_size=32)),
    Case("experts of zero width", plan(), ("config.json", "moe_intermediate_size"),
         cfg(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=0)),
    Case("no experts", plan(), ("config.json", "num_local_experts"),
         cfg(model_type="mixtral", num_local_experts=0, num_experts_per_tok=2)),
    Case("a dense layer past the last layer", plan(), ("config.json", "mlp_only_layers"),
         cfg(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, mlp_only_layers=[0, 99])),
    Case("no layer left with experts", plan(), ("config.json", "decoder_sparse_step"),
         cfg(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, decoder_sparse_step=999)),
    Case("a negative router loss weight", plan(), ("config.json", "router_aux_loss_coef"),
         cfg(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
             output_router_logits=True, router_aux_loss_coef=-0.01)),
    Case("GPT-OSS with a router loss weight that is text", plan(),
         ("config.json", "router_aux_loss_coef"),
         cfg(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
             output_router_logits=True, router_aux_loss_coef="0.001")),
    Case("GPT-OSS with a negative SwiGLU limit", plan(), ("config.json", "swiglu_limit"),
         cfg(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
             swiglu_limit=-7.0)),
    Case("YaRN without its original context", plan(),
         ("config.json", "original_max_position_embeddings"),
         cfg(rope_scaling={"rope_type": "yarn", "factor": 32.0})),
    Case("layer_types of the wrong length", plan(), ("config.json", "layer_types", "2"),
         cfg(model_type="qwen2", use_sliding_window=True, sliding_window=16,
             layer_types=["full_attention"] * 3)),
    Case("a layer type this engine does not train", plan(), ("config.json", "linear_attention"),
         cfg(model_type="qwen2", use_sliding_window=True, sliding_window=16,
             layer_types=["linear_attention", "full_attention"])),
    Case("sliding layers without a window", plan(), ("config.json", "sliding_window"),
         cfg(model_type="qwen2", use_sliding_window=True, sliding_window=None,
             layer_types=["sliding_attention", "full_attention"])),
    Case("a sliding window of 0 tokens", plan(), ("config.json", "sliding_window"),
         cfg(model_type="gemma3_text", sliding_window=0, hidden_act=DELETE)),
    Case("no_rope_layers of the wrong length", plan(), ("config.json", "no_rope_layers"),
         cfg(model_type="smollm3", no_rope_layers=[1])),
    Case("logit soft-capping", plan(), ("config.json", "final_logit_softcapping"),
         cfg(model_type="gemma3_text", final_logit_softcapping=30.0, hidden_act=DELETE)),
    Case("an activation the family does not compute", plan(), ("config.json", "hidden_act"),
         cfg(hidden_act="gelu")),
    Case("OLMoE clamping q, k and v", plan(), ("config.json", "clip_qkv", "null"),
         cfg(model_type="olmoe", num_experts=4, num_experts_per_tok=2, clip_qkv=8.0)),
    Case("partial rotary embeddings over the whole head", plan(),
         ("config.json", "partial_rotary_factor"),
         cfg(model_type="phi3", partial_rotary_factor=1.5)),
    Case("partial rotary embeddings turning no dimension", plan(),
         ("config.json", "partial_rotary_factor", "even"),
         cfg(model_type="phi3", partial_rotary_factor=0.01)),
    Case("a Phi-3 'yarn' RoPE, which transformers reads as LongRoPE", plan(),
         ("config.json", "yarn", "longrope"),
         cfg(model_type="phi3", rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                              "original_max_position_embeddings": 64})),
    Case("LongRoPE factors that are not numbers", plan(), ("config.json", "long_factor"),
         cfg(model_type="phi3", rope_scaling={"rope_type": "longrope",
                                              "short_factor": [1.0] * 8,
                                              "long_factor": ["x"] * 8})),
    Case("rope_scaling type a list", plan(), ("config.json", "rope_scaling"),
         cfg(rope_scaling={"rope_type": ["linear"], "factor": 2.0})),
    Case("rope_parameters of an unknown type", plan(), ("config.json", "rope_parameters"),
         cfg(rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0})),
    Case("torch_dtype a lone surrogate", plan(), ("config.json", "torch_dtype", "surrogate"),
         cfg(torch_dtype="bf\ud800")),
    Case("config.json without num_hidden_layers", plan(), ("config.json", "num_hidden_layers"),
         cfg(num_hidden_layers=DELETE)),
    Case("hidden_size that the weights do not have", train(),
         ("model.safetensors", "config.json implies"), cfg(hidden_size=64)),
    Case("sizes too big for RAM that the weights do not have", train(),
         ("model.safetensors", "config.json implies"),
         cfg(vocab_size=2**24, hidden_size=8192, num_hidden_layers=200, intermediate_size=2**15)),
    Case("index naming a 5000-character shard", train(), (INDEX,),
         broken(index_breakage({EMBED: "a" * 5000 + ".safetensors"}, {}))),
    Case("index with an empty weight_map", train(), (INDEX, "weight_map"),
         broken(index_breakage({}, {}))),
    Case("index naming tokenizer.json as a shard", train(), (INDEX, "tokenizer.json"),
         broken(index_breakage({EMBED: "tokenizer.json"}, {}))),
    Case("index naming a shard without the tensors", train(), (INDEX, EMBED),
         lambda w: (write("model/empty.safetensors", b"\x02\0\0\0\0\0\0\0{}")(w),
                    broken(index_breakage({EMBED: "empty.safetensors"}, {}))(w))),
    Case("safetensors offsets reversed", train(), ("model.safetensors",),
         broken(tensor_breakage(0, "data_offsets", [100, 4]))),
    Case("safetensors shape negative", train(), ("model.safetensors", "shape"),
         broken(tensor_breakage(0, "shape", [-32]))),
    Case("safetensors dtype F8_E4M3", train(), ("model.safetensors", "F8_E4M3"),
         broken(tensor_breakage(3, "dtype", "F8_E4M3"))),
    Case("safetensors __metadata__ a list", train(), ("model.safetensors",),
         broken(header_breakage("__metadata__", [1]))),
    Case("safetensors header length 2**63", train(), ("model.safetensors", "header"),
         broken(length_breakage(2**63))),
    Case("safetensors cut in half", train(), ("model.safetensors", "truncated"),
         broken(truncated("model.safetensors", 0.5))),
    Case("tokenizer.json without its added tokens", train(), ("tokenizer.json", "one token"),
         broken(tokenizer_json_breakage("added_tokens", []))),
    Case("tokenizer.json cut short", train(), ("tokenizer.json",),
         broken(truncated("tokenizer.json", 0.3))),
    Case("eos_token a lone surrogate", train(),
         ("tokenizer_config.json", "eos_token", "surrogate"),
         broken(tokenizer_config_breakage("eos_token", "<|im_end|>\ud800"))),
    Case("chat_template.jinja rendering no reply", train(), ("chat_template.jinja", "render"),
         broken(jinja_breakage(b"{{ messages[0]['content'] }}"))),
    Case("chat_template empty", train(), ("tokenizer_config.json", "chat_template"),
         broken(tokenizer_config_breakage("chat_template", ""))),
    Case("data.chat_template file not UTF-8", setkey("data.chat_template", '"t.jinja"'),
         ("t.jinja", "UTF-8"), write("t.jinja", b"\xff{{ messages }}")),
]

CORPUS = {**CATEGORIES, "model folders": MODEL_FOLDERS, "gguf files": GGUF_FILES,
          "adapter folders": ADAPTER_FOLDERS}
"""Every category of the hostile corpus."""
