"""GGUF file -> Hugging Face folder (bf16 safetensors, config.json, tokenizer, chat template).

The weights are dequantised and written one tensor at a time (peak memory: one tensor in fp32
and its bf16 copy), with llama.cpp's Q/K row order undone (:mod:`slideformer.engine.gguf.names`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.names import (GGUF_ARCHS, from_gguf_order, model_type_of, norm_shift, qk_heads,
                                          tensor_names)
from slideformer.engine.gguf.reader import GGUFFile
from slideformer.engine.gguf.tokenizer import build_tokenizer, tokenizer_config
from slideformer.engine.models.spec import SUPPORTED, ModelSpec, spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config
from slideformer.engine.models.weights import (hf_name, item_layout, item_names, publish_dir, staging_dir,
                                   stored_as, write_streamed_shards)


def _family(g: GGUFFile) -> tuple[str, str]:
    """(GGUF architecture, Hugging Face model_type) of the file."""
    arch = g.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UserError(g.path, f"is a GGUF of architecture {arch!r}, which is not supported",
                        f"use a GGUF of a supported family: {', '.join(SUPPORTED)} "
                        f"(architectures {', '.join(GGUF_ARCHS)})")
    # llama.cpp writes Mistral as "llama"; the name tells them apart (as transformers reads it)
    if arch == "llama" and "mistral" in str(g.get("general.name", "")).lower():
        return arch, "mistral"
    return arch, model_type_of(arch)


def _float(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(f"{float(v):.7g}")


def _rope_scaling(g: GGUFFile, arch: str) -> dict | None:
    kind = g.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in g.tensors:
        raise UserError(g.path, "uses per-frequency RoPE factors (rope_freqs, e.g. Llama 3.1 "
                                "scaling), which import cannot turn back into rope_scaling",
                        "import the model from its Hugging Face folder instead")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise UserError(g.path, f"uses RoPE scaling {kind!r}", "supported: none, linear")
    return {"rope_type": "linear", "factor": _float(g.get(f"{arch}.rope.scaling.factor"))}


def gguf_config(g: GGUFFile) -> dict:
    """The config.json of the model in a GGUF file."""
    arch, family = _family(g)
    need = lambda key: _required(g, f"{arch}.{key}")  # noqa: E731
    hidden, heads = need("embedding_length"), need("attention.head_count")
    if "token_embd.weight" not in g.tensors:
        raise UserError(g.path, "has no token_embd.weight tensor", "use a complete GGUF file")
    head_dim = g.get(f"{arch}.attention.key_length") or g.get(f"{arch}.rope.dimension_count")
    shape = TinyShape(layers=need("block_count"), hidden=hidden, heads=heads,
                      kv_heads=g.get(f"{arch}.attention.head_count_kv", heads),
                      intermediate=need("feed_forward_length"),
                      vocab=g.shape("token_embd.weight")[0],
                      head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
                      tie="output.weight" not in g.tensors,
                      max_positions=g.get(f"{arch}.context_length", 4096))
    cfg = tiny_config(family, shape)  # the config.json keys of a model of this shape
    cfg.update(rms_norm_eps=_float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
               rope_theta=_float(g.get(f"{arch}.rope.freq_base", 10000.0)), torch_dtype="bfloat16")
    if family in ("llama", "mistral") and "blk.0.attn_q.bias" in g.tensors:
        cfg["attention_bias"] = True
    if "blk.0.ffn_up.bias" in g.tensors:
        cfg["mlp_bias"] = True
    if (rs := _rope_scaling(g, arch)) is not None:
        cfg["rope_scaling"] = rs
    if family == "gemma3_text":
        cfg.update(_gemma3(g, arch, shape))
    if family == "qwen3_moe":  # llama.cpp renormalises the top-k routing weights
        cfg.update(num_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"),
                   moe_intermediate_size=need("expert_feed_forward_length"), norm_topk_prob=True)
    for key, gkey in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if g.get(f"tokenizer.ggml.{gkey}") is not None:
            cfg[key] = int(g.get(f"tokenizer.ggml.{gkey}"))
    return cfg


def _gemma3(g: GGUFFile, arch: str, shape: TinyShape) -> dict:
    """Gemma 3's config keys as llama.cpp derives them: every 6th layer full, the others
    windowed with RoPE base 10000; scores scaled by 1/sqrt(head_dim), except the 27B's
    (62 layers: 1/sqrt(hidden / heads))."""
    every = g.get(f"{arch}.attention.sliding_window_pattern") or 6
    scalar = shape.hidden // shape.heads if shape.layers == 62 else (shape.head_dim or
                                                                    shape.hidden // shape.heads)
    return {"sliding_window": _required(g, f"{arch}.attention.sliding_window"),
            "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention"
                            for i in range(shape.layers)],
            "query_pre_attn_scalar": scalar, "rope_local_base_freq": 10000.0}


def _required(g: GGUFFile, key: str) -> int:
    v = g.get(key)
    if not isinstance(v, int) or v <= 0:
        raise UserError(g.path, f"has no valid '{key}' in its metadata", "use a complete GGUF file")
    return v


def _tokenizer_meta(g: GGUFFile) -> dict:
    meta = {k.removeprefix("tokenizer.ggml."): v for k, v in g.meta.items()
            if k.startswith("tokenizer.ggml.")}
    if "tokens" not in meta:
        raise UserError(g.path, "has no tokenizer (tokenizer.ggml.tokens)",
                        "use a GGUF file that carries its tokenizer")
    return meta


def importable(g) -> ModelSpec:
    """The spec of the model in ``g`` (a :class:`GGUFFile`, or a header read without the
    tensors, :class:`slideformer.engine.gguf.header.GGUFHeader`), once every check that import
    makes before it reads a tensor has passed.

    Raises:
        UserError: why import would refuse the file, in its words.
    """
    spec = spec_from_config(gguf_config(g), g.path)
    _check_tensors(g, spec, tensor_names(spec))
    g.check_types()
    _tokenizer_meta(g)
    return spec


def import_gguf(path: Path | str, out: Path | str, max_shard_bytes: int = 5 << 30,
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Turn the GGUF file ``path`` into the Hugging Face folder ``out`` (which must not exist).

    Args:
        max_shard_bytes: safetensors shard size limit (several shards get an index).
        progress: called with (tensors written, total) after each tensor.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(out, "exists and is not empty", "choose a new folder for --out")
    g = GGUFFile(path)
    spec = importable(g)
    cfg, names, tok_meta = spec.raw_config, tensor_names(spec), _tokenizer_meta(g)
    tok = build_tokenizer(tok_meta, g.path)  # before the weights: a bad tokenizer fails fast
    stored = _stored_names(spec)  # stacked experts: one checkpoint tensor per expert
    shapes = [(name, g.shape(gg)[1:] if len(stored[hf]) > 1 else g.shape(gg))
              for hf, gg in names.items() for name in stored[hf]]

    def tensors():
        for i, (hf, gg) in enumerate(names.items()):
            w = np.require(g.tensor(gg), requirements="W")  # mapped F32 data is read-only
            if (heads := qk_heads(spec, hf)) is not None:
                w = from_gguf_order(w, heads)
            if shift := norm_shift(spec, hf):
                w = w - shift
            t = torch.from_numpy(w)
            yield from (t if len(stored[hf]) > 1 else [t])
            if progress is not None:
                progress(i + 1, len(names))

    tmp = staging_dir(out)
    write_streamed_shards(tmp, shapes, tensors(), max_shard_bytes)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save(str(tmp / "tokenizer.json"))
    template = g.get("tokenizer.chat_template") or spec.family.chat_template
    tc = tokenizer_config(tok_meta, template, spec.max_position_embeddings)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    return publish_dir(tmp, out)


def _stored_names(spec) -> dict[str, list[str]]:
    """Engine tensor name (as :func:`tensor_names` keys them) -> its checkpoint names."""
    return {hf_name(item, local): stored_as(spec, item, local) for item in item_names(spec)
            for local in item_layout(spec, item).names()}


def _check_tensors(g: GGUFFile, spec, names: dict[str, str]) -> None:
    """Every tensor the model needs is in the file with its shape, and nothing else is."""
    want = {hf_name(item, n): shape for item in item_names(spec)
            for n, _, shape in item_layout(spec, item).entries}
    for hf, gg in names.items():
        if gg not in g.tensors:
            raise UserError(g.path, f"has no tensor '{gg}' (the model's {hf})",
                            "use a complete GGUF file of a supported family")
        if g.shape(gg) != tuple(want[hf]):
            raise UserError(g.path, f"tensor '{gg}' has shape {list(g.shape(gg))}, its "
                                    f"metadata implies {list(want[hf])}", "use a consistent GGUF file")
    extra = sorted(set(g.tensors) - set(names.values()))
    if extra:
        raise UserError(g.path, f"has tensors a {spec.model_type} model does not use: "
                                f"{', '.join(extra[:5])}", "use a GGUF of a supported family")
