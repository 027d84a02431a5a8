"""GGUF file -> Hugging Face folder (bf16 safetensors, config.json, tokenizer, chat template).

The weights are dequantised and written one tensor at a time (peak memory: one tensor in fp32
and its bf16 copy), with what llama.cpp's converter did to them undone
(:mod:`slideformer.engine.gguf.transforms`: Q/K row order, norm offsets, Qwen3.5's DeltaNet).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.gguf import archs, gemma4, metadata, qwen35
from slideformer.engine.gguf.names import GGUF_ARCHS, model_type_of, tensor_names
from slideformer.engine.gguf.reader import GGUFFile
from slideformer.engine.gguf.tokenizer import build_tokenizer, tokenizer_config
from slideformer.engine.gguf.transforms import from_gguf, gguf_shape
from slideformer.engine.models.families.base import Moe
from slideformer.engine.models.spec import FAMILIES, SUPPORTED, ModelSpec, spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config
from slideformer.engine.models.tokenizer import compile_template
from slideformer.engine.models.weights import (hf_name, item_layout, item_names, publish_dir, staging_dir,
                                   stored_as, write_streamed_shards)


def _family(g: GGUFFile) -> tuple[str, str]:
    """(GGUF architecture, Hugging Face model_type) of the file."""
    arch = metadata.value(g, "general.architecture", str)
    if arch not in GGUF_ARCHS:
        raise UserError(g.path, f"is a GGUF of architecture {arch!r}, which is not supported",
                        f"use a GGUF of a supported family: {', '.join(SUPPORTED)} "
                        f"(architectures {', '.join(GGUF_ARCHS)})")
    family = archs.model_type(g, arch, model_type_of(arch))  # Mixtral: llama with experts
    # llama.cpp writes Mistral as "llama"; the name tells them apart (as transformers reads it)
    if family == "llama" and "mistral" in metadata.value(g, "general.name", str, "").lower():
        return arch, "mistral"
    return arch, family


def _float(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(f"{float(v):.7g}")


def _rope_scaling(g: GGUFFile, arch: str) -> dict | None:
    kind = metadata.value(g, f"{arch}.rope.scaling.type", str)
    if "rope_freqs.weight" in g.tensors and arch != gemma4.ARCH:  # Gemma 4's: archs.config
        raise UserError(g.path, "uses per-frequency RoPE factors (rope_freqs, e.g. Llama 3.1 "
                                "scaling), which import cannot turn back into rope_scaling",
                        "import the model from its Hugging Face folder instead")
    if kind in (None, "none"):
        return None
    if kind == "yarn":
        return archs.yarn_config(g, arch)
    if kind != "linear":
        raise UserError(g.path, f"uses RoPE scaling {kind!r}", "supported: none, linear, yarn")
    factor = metadata.value(g, f"{arch}.rope.scaling.factor", float)
    if factor is None:
        raise UserError(g.path, f"has linear RoPE scaling without '{arch}.rope.scaling.factor'",
                        "use a complete GGUF file")
    return {"rope_type": "linear", "factor": _float(factor)}


def gguf_config(g: GGUFFile) -> dict:
    """The config.json of the model in a GGUF file."""
    arch, family = _family(g)
    fam = FAMILIES[family]
    need = lambda key: _required(g, f"{arch}.{key}")  # noqa: E731
    number = lambda key, kind, default=None: metadata.value(g, f"{arch}.{key}", kind, default)  # noqa: E731
    hidden, heads = need("embedding_length"), need("attention.head_count")
    vocab = _vocab_rows(g, arch)
    key_length, rope_dims = number("attention.key_length", int), number("rope.dimension_count", int)
    head_dim = key_length or (hidden // heads if fam.linear else rope_dims)  # partial RoPE
    ffn = number("feed_forward_length", int) if fam.moe else need("feed_forward_length")
    shape = TinyShape(layers=_layers(g, arch), hidden=hidden, heads=heads,
                      kv_heads=_kv_heads(g, arch, heads),
                      intermediate=ffn or need("expert_feed_forward_length"), vocab=vocab,
                      head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
                      tie="output.weight" not in g.tensors,
                      max_positions=number("context_length", int, 4096))
    cfg = tiny_config(family, shape)  # the config.json keys of a model of this shape
    cfg.update(rms_norm_eps=_float(number("attention.layer_norm_rms_epsilon", float, 1e-6)),
               rope_theta=_float(number("rope.freq_base", float, 10000.0)), torch_dtype="bfloat16")
    if family in ("llama", "mistral") and "blk.0.attn_q.bias" in g.tensors:
        cfg["attention_bias"] = True
    if "blk.0.ffn_up.bias" in g.tensors:
        cfg["mlp_bias"] = True
    if (rs := _rope_scaling(g, arch)) is not None:
        cfg["rope_scaling"] = rs
    if family == "gemma3_text":
        cfg.update(_gemma3(g, arch, shape))
    if fam.linear:  # Qwen3.5: the RoPE base goes into rope_parameters
        cfg.update(qwen35.config(g, arch, shape.layers, shape.head_dim or hidden // heads,
                                 cfg.pop("rope_theta")))
    if fam.moe is not None and (fam.moe.enable_key is None
                                or g.get(f"{arch}.expert_count") is not None):
        cfg.update(_experts(g, arch, fam.moe, shape.intermediate))
    cfg = archs.config(g, arch, family, shape.layers, shape.head_dim or hidden // heads, cfg)
    for key, gkey in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if (token := metadata.value(g, f"tokenizer.ggml.{gkey}", int)) is not None:
            cfg[key] = token
    return cfg


def _kv_heads(g: GGUFFile, arch: str, heads: int) -> int:
    """``attention.head_count_kv``; Gemma 4's holds one per layer (the first stands in here,
    archs.config reads them all)."""
    key = f"{arch}.attention.head_count_kv"
    if arch == gemma4.ARCH and isinstance(g.get(key), list):
        return (metadata.array(g, key, int) or [heads])[0]
    return metadata.value(g, key, int, heads)


def _experts(g: GGUFFile, arch: str, moe: Moe, dense: int) -> dict:
    """The experts' config keys, as the family names them (Mixtral: ``num_local_experts`` and
    ``intermediate_size``). Whether the top-k routing weights are renormalised is the
    architecture's (archs.RENORMALISED: Qwen3-MoE's ``norm_topk_prob`` true, OLMoE's false);
    a shared expert's width defaults to the dense one; a Mixtral or OLMoE expert's width is
    ``feed_forward_length`` (what llama.cpp sizes their experts by)."""
    need = lambda key: _required(g, f"{arch}.{key}")  # noqa: E731
    width = dense if arch in ("llama", "olmoe") else need("expert_feed_forward_length")
    out = {moe.count_keys[0]: need("expert_count"), moe.top_k_key: need("expert_used_count"),
           moe.width_key: width}
    if isinstance(moe.renormalise, str):
        out[moe.renormalise] = archs.RENORMALISED.get(arch, True)
    if moe.shared is not None:
        out["shared_expert_intermediate_size"] = metadata.value(
            g, f"{arch}.expert_shared_feed_forward_length", int) or dense
    return out


def _layers(g: GGUFFile, arch: str) -> int:
    """The decoder layers: ``block_count`` less the multi-token-prediction block llama.cpp's
    converter appends (``nextn_predict_layers``), which import leaves out."""
    layers = _required(g, f"{arch}.block_count")
    nextn = metadata.value(g, f"{arch}.nextn_predict_layers", int, 0)
    if not 0 <= nextn < layers:
        raise UserError(g.path, f"has '{arch}.nextn_predict_layers' = {nextn} of its {layers} "
                        "blocks", "use a consistent GGUF file")
    return layers - nextn


def _vocab_rows(g: GGUFFile, arch: str) -> int:
    """The rows of token_embd.weight, which ``{arch}.vocab_size`` must agree with."""
    if "token_embd.weight" not in g.tensors:
        raise UserError(g.path, "has no token_embd.weight tensor", "use a complete GGUF file")
    shape = g.shape("token_embd.weight")
    if len(shape) != 2:
        raise UserError(g.path, f"has token_embd.weight of shape {list(shape)}, not (vocabulary, "
                        "hidden size)", "use a complete GGUF file")
    said = metadata.value(g, f"{arch}.vocab_size", int)
    if said is not None and said != shape[0]:
        raise UserError(g.path, f"says '{arch}.vocab_size' = {said:,}, but token_embd.weight "
                        f"has {shape[0]:,} rows", "use a consistent GGUF file")
    return shape[0]


def _gemma3(g: GGUFFile, arch: str, shape: TinyShape) -> dict:
    """Gemma 3's config keys as llama.cpp derives them: every 6th layer full, the others
    windowed with RoPE base 10000; scores scaled by 1/sqrt(head_dim), except the 27B's
    (62 layers: 1/sqrt(hidden / heads))."""
    every = metadata.value(g, f"{arch}.attention.sliding_window_pattern", int) or 6
    scalar = shape.hidden // shape.heads if shape.layers == 62 else (shape.head_dim or
                                                                    shape.hidden // shape.heads)
    return {"sliding_window": _required(g, f"{arch}.attention.sliding_window"),
            "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention"
                            for i in range(shape.layers)],
            "query_pre_attn_scalar": scalar, "rope_local_base_freq": 10000.0}


def _required(g: GGUFFile, key: str) -> int:
    v = metadata.value(g, key, int)
    if v is None or v <= 0:
        raise UserError(g.path, f"has no valid '{key}' in its metadata", "use a complete GGUF file")
    return v


_TOKENIZER_ARRAYS = {"tokens": str, "token_type": int, "merges": str, "scores": float}
_TOKENIZER_VALUES = {"model": str, "pre": str, "add_bos_token": bool, "add_space_prefix": bool}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")
_TOKENIZER_FIX = "use a GGUF file whose tokenizer is complete, as llama.cpp's converter writes it"


def _tokenizer_meta(g: GGUFFile) -> dict:
    """The ``tokenizer.ggml.*`` keys without the prefix, each of its type, and consistent: one
    type (and score) per token, no more tokens than token_embd.weight has rows (a shorter
    vocabulary is a padded embedding, as llama.cpp takes it), the special ids among them."""
    get = lambda key, read, kind: read(g, f"tokenizer.ggml.{key}", kind)  # noqa: E731
    meta = {k: get(k, metadata.array, kind) for k, kind in _TOKENIZER_ARRAYS.items()}
    meta |= {k: get(k, metadata.value, kind) for k, kind in _TOKENIZER_VALUES.items()}
    meta |= {k: get(k, metadata.value, int) for k in _TOKEN_IDS}
    meta = {k: v for k, v in meta.items() if v is not None}
    if "tokens" not in meta:
        raise UserError(g.path, "has no tokenizer (tokenizer.ggml.tokens)",
                        "use a GGUF file that carries its tokenizer")
    n, rows = metadata.length(meta["tokens"]), g.shape("token_embd.weight")[0]
    if not 0 < n <= rows:
        raise UserError(g.path, f"has {n:,} tokens (tokenizer.ggml.tokens) for the {rows:,} rows "
                        "of token_embd.weight", _TOKENIZER_FIX)
    if "token_type" not in meta:  # without it every special token would be split as text
        raise UserError(g.path, "has no tokenizer.ggml.token_type (which tokens are special)",
                        _TOKENIZER_FIX)
    for key in ("token_type", "scores"):
        if key in meta and metadata.length(meta[key]) != n:
            raise UserError(g.path, f"has {metadata.length(meta[key]):,} entries in "
                            f"tokenizer.ggml.{key} for its {n:,} tokens", _TOKENIZER_FIX)
    if meta.get("model") == "gpt2" and "merges" not in meta:
        raise UserError(g.path, "has a byte-level BPE tokenizer without tokenizer.ggml.merges",
                        _TOKENIZER_FIX)
    for key in _TOKEN_IDS:
        if key in meta and not 0 <= meta[key] < n:
            raise UserError(g.path, f"has tokenizer.ggml.{key} = {meta[key]:,}, which is not one "
                            f"of its {n:,} tokens", _TOKENIZER_FIX)
    return meta


def _check_special_tokens(g: GGUFFile, tok, meta: dict) -> None:
    """Each special token encodes as its one id, as training needs (models.tokenizer checks the
    imported folder the same way): an empty text, or a second token of the same text, fails."""
    for key in _TOKEN_IDS:
        if key in meta:
            text = meta["tokens"][meta[key]]
            if tok.encode(text, add_special_tokens=False).ids != [meta[key]]:
                raise UserError(g.path, f"has the token {text!r} as tokenizer.ggml.{key} "
                                f"{meta[key]}, but that text does not encode as that one token",
                                _TOKENIZER_FIX)


def _chat_template(g: GGUFFile) -> str | None:
    """``tokenizer.chat_template``, compiled once in the sandbox it will render in."""
    template = metadata.value(g, "tokenizer.chat_template", str)
    if template:
        try:
            compile_template(template, g.path)
        except UserError as e:
            raise UserError(g.path, f"has a tokenizer.chat_template that does not compile "
                            f"({e.problem})", "use another GGUF file of the model, or import it "
                            "from its Hugging Face folder") from None
    return template


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
    _chat_template(g)
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
    _check_special_tokens(g, tok, tok_meta)
    stored, layout = _stored_names(spec), _layout_shapes(spec)  # stacked experts: one
    shapes = [(name, layout[hf][1:] if len(stored[hf]) > 1 else layout[hf])  # tensor per expert
              for hf in names for name in stored[hf]]

    def tensors():
        for i, (hf, gg) in enumerate(names.items()):
            w = np.require(g.tensor(gg), requirements="W")  # mapped F32 data is read-only
            if not np.isfinite(w).all():
                raise UserError(g.path, f"tensor '{gg}' holds NaN or infinite values",
                                "use another GGUF file of the model: these weights are corrupt")
            w = from_gguf(spec, hf, w)
            if not np.isfinite(w).all():  # ssm_a = -exp(A_log) is negative
                raise UserError(g.path, f"tensor '{gg}' holds values that no {hf} converts "
                                "to", "use another GGUF file of the model: these weights are "
                                "corrupt")
            t = torch.from_numpy(np.ascontiguousarray(w))
            yield from (t if len(stored[hf]) > 1 else [t])
            if progress is not None:
                progress(i + 1, len(names))

    tmp = staging_dir(out)
    try:
        write_streamed_shards(tmp, shapes, tensors(), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save(str(tmp / "tokenizer.json"))
        template = _chat_template(g) or spec.family.chat_template
        tc = tokenizer_config(tok_meta, template, spec.max_position_embeddings)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    except BaseException:  # nothing half-written is left next to --out
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_dir(tmp, out)


def _block(tensor: str) -> int | None:
    """N of a tensor ``blk.N.*``, else None."""
    parts = tensor.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdecimal() \
        else None


def _stored_names(spec) -> dict[str, list[str]]:
    """Engine tensor name (as :func:`tensor_names` keys them) -> its checkpoint names."""
    return {hf_name(item, local): stored_as(spec, item, local) for item in item_names(spec)
            for local in item_layout(spec, item).names()}


def _layout_shapes(spec) -> dict[str, tuple[int, ...]]:
    """Engine tensor name -> its shape in the engine (stacked experts: all of them)."""
    return {hf_name(item, n): tuple(shape) for item in item_names(spec)
            for n, _, shape in item_layout(spec, item).entries}


def _check_tensors(g: GGUFFile, spec, names: dict[str, str]) -> None:
    """Every tensor the model needs is in the file with its shape, and nothing else is but
    the multi-token-prediction block after the layers (llama.cpp's nextn layers)."""
    layout = _layout_shapes(spec)
    wanted = {gg: (hf, gguf_shape(hf, layout[hf])) for hf, gg in names.items()}
    wanted |= {name: (name, shape) for name, shape in archs.extra_shapes(spec).items()}
    for gg, (hf, want) in wanted.items():
        if gg not in g.tensors:
            raise UserError(g.path, f"has no tensor '{gg}' (the model's {hf})",
                            "use a complete GGUF file of a supported family")
        if g.shape(gg) != want:
            raise UserError(g.path, f"tensor '{gg}' has shape {list(g.shape(gg))}, its "
                                    f"metadata implies {list(want)}", "use a consistent GGUF file")
    blocks = metadata.value(g, f"{spec.family.gguf}.block_count", int)
    extra = sorted(t for t in set(g.tensors) - set(wanted)
                   if _block(t) not in range(spec.num_layers, blocks))
    if extra:
        raise UserError(g.path, f"has tensors a {spec.model_type} model does not use: "
                                f"{', '.join(extra[:5])}", "use a GGUF of a supported family")
