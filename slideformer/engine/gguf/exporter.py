"""Hugging Face folder -> GGUF file (``gguf.GGUFWriter``), streamed one layer at a time.

The tensor table (names, shapes, types, byte sizes) is known from config.json alone, so the
writer's header goes out first and each tensor is read, converted and written in turn (peak
memory: one decoder layer in fp32 and one converted tensor). The file is written under a
temporary name and renamed when complete.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.gguf import archs, gemma4, qwen35
from slideformer.engine.gguf.kinds import EXPORT_KINDS
from slideformer.engine.gguf.names import arch_name, tensor_names
from slideformer.engine.gguf.tokenizer import gguf_vocab
from slideformer.engine.gguf.transforms import gguf_shape, to_gguf
from slideformer.engine.models.spec import ModelSpec, load_spec
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.engine.models.weights import Checkpoint, hf_name, item_layout, item_names

Q = gguf.GGMLQuantizationType
TYPES = dict(zip(EXPORT_KINDS, (Q.F32, Q.BF16, Q.F16, Q.Q8_0, Q.Q4_0)))
"""--type -> the GGUF type of the matrices (1-D tensors, norms and biases, stay F32)."""
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}


@dataclass(frozen=True)
class Planned:
    """One tensor of the output file."""

    hf: str
    """Checkpoint name in the folder."""
    gguf: str
    """Tensor name in the GGUF file."""
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType


KEPT_F32 = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")
"""Matrices llama.cpp's converter always stores in F32: the routers, the shared expert's gate,
the DeltaNet convolution (ggml's CPU ``ssm_conv`` takes F32 only)."""


def tensor_type(name: str, shape: tuple[int, ...], kind: str) -> gguf.GGMLQuantizationType:
    """The GGUF type of tensor ``name`` (its GGUF name) under ``--type kind``."""
    if len(shape) == 1 or name.endswith(KEPT_F32):
        return Q.F32
    qtype = TYPES[kind]
    # 4-bit embeddings and LM head cost the most quality per byte saved (llama.cpp keeps them
    # at 6 bits or more in its 4-bit files): they get Q8_0.
    if qtype == Q.Q4_0 and name in ("token_embd.weight", "output.weight"):
        qtype = Q.Q8_0
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else Q.F16  # rows not a whole number of blocks


def convert(w: np.ndarray, qtype) -> np.ndarray:
    """fp32 -> the bytes (or float16/float32 array) the writer stores for ``qtype``."""
    return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype)


def _byte_shape(shape, qtype) -> tuple[tuple[int, ...], np.dtype, int]:
    if qtype == Q.F32:
        return shape, np.float32, 4 * math.prod(shape)
    if qtype == Q.F16:
        return shape, np.float16, 2 * math.prod(shape)
    bshape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    return bshape, np.uint8, math.prod(bshape)


def plan(spec: ModelSpec, kind: str) -> list[Planned]:
    names = tensor_names(spec)
    out = []
    for item in item_names(spec):
        for local, _, shape in item_layout(spec, item).entries:
            hf = hf_name(item, local)
            shape = gguf_shape(hf, shape)
            out.append(Planned(hf, names[hf], shape, tensor_type(names[hf], shape, kind)))
    return out


def _tensors(model_dir: Path, spec: ModelSpec, planned: list[Planned]) -> Iterator[np.ndarray]:
    """The converted tensors in ``planned`` order, read one item (layer) at a time."""
    ckpt = Checkpoint(model_dir)
    by_name = {p.hf: p for p in planned}
    for item in item_names(spec):
        layout = item_layout(spec, item)
        flat = ckpt.read_item(spec, item, torch.empty(layout.numel, dtype=torch.float32))
        for local, view in layout.views(flat).items():
            hf = hf_name(item, local)
            yield convert(to_gguf(spec, hf, view.numpy()), by_name[hf].qtype)
    ckpt.close()


def _write_metadata(w: gguf.GGUFWriter, spec: ModelSpec, model_dir: Path, name: str,
                    kind: str) -> None:
    w.add_name(name)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    kv, head_dim, rotary = _attention_sizes(spec)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_dimension_count(rotary)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(spec.vocab_size)
    w.add_file_type(FILE_TYPES[kind])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rs = dict(spec.rope_scaling or ())
    if rs.get("rope_type", rs.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rs["factor"]))
    if spec.model_type == "gemma3_text":
        _check_gemma3(spec, model_dir)
        w.add_sliding_window(spec.sliding_window)
    if spec.moe is not None:
        w.add_expert_count(spec.moe.experts)
        w.add_expert_used_count(spec.moe.top_k)
        w.add_expert_feed_forward_length(spec.moe.width)
        if spec.moe.shared_width:
            w.add_expert_shared_feed_forward_length(spec.moe.shared_width)
    if spec.family.linear:
        qwen35.write_metadata(w, spec, model_dir)
    if spec.family.gguf == gemma4.ARCH:
        gemma4.write_metadata(w, spec)
    archs.write_metadata(w, spec)
    _write_tokenizer(w, spec, model_dir)


def _attention_sizes(spec: ModelSpec) -> tuple[int | list[int], int, int]:
    """(``head_count_kv``, ``key_length``, ``rope.dimension_count``): Gemma 4's are its full
    layers' head size (both: the proportional RoPE turns pairs of the whole head) and a KV
    head count per layer (:mod:`slideformer.engine.gguf.gemma4`)."""
    if spec.family.gguf == gemma4.ARCH:
        hd = gemma4.full_head_dim(spec)
        return gemma4.kv_heads(spec), hd, hd
    return spec.num_kv_heads, spec.head_dim, spec.rotary_dim or spec.head_dim


def _check_gemma3(spec: ModelSpec, model_dir: Path) -> None:
    """Refuse a Gemma 3 that llama.cpp would compute differently: it fixes what the GGUF does
    not say, every sixth layer global (the others sliding), local layers' RoPE base 10,000 and
    scores scaled by head_dim ** -0.5 (query_pre_attn_scalar = head_dim, as the released
    models have; the 27B's own rule aside). Measured against llama.cpp: tests/engine/gguf/
    test_llama_cpp.py."""
    cfg = model_dir / "config.json"
    pattern = tuple("full_attention" if i % 6 == 5 else "sliding_attention"
                    for i in range(spec.num_layers))
    for bad, what in ((spec.layer_types != pattern, f"layer_types {list(spec.layer_types)}, "
                       "where llama.cpp makes every sixth layer global and the others sliding"),
                      (spec.local_rope is None or spec.local_rope[0] != 10000.0,
                       "a local RoPE base other than the 10,000 llama.cpp uses"),
                      (spec.attn_scale is not None
                       and abs(spec.attn_scale * spec.head_dim ** 0.5 - 1) > 1e-6,
                       "query_pre_attn_scalar other than head_dim, llama.cpp's score scale")):
        if bad:
            raise UserError(cfg, f"has {what}: llama.cpp would compute another model from the "
                            "GGUF", "keep the model in its Hugging Face folder (the Gemma 3 "
                            "releases export as they are)")


def _write_tokenizer(w: gguf.GGUFWriter, spec: ModelSpec, model_dir: Path) -> None:
    meta = gguf_vocab(model_dir, spec.vocab_size)
    tok = load_tokenizer(model_dir)
    w.add_tokenizer_model(meta["model"])
    w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["token_type"])
    if meta["model"] == "llama":  # SentencePiece: merges by score, spaces as they are
        w.add_token_scores(meta["scores"])
        w.add_add_space_prefix(False)
    else:
        w.add_token_merges(meta["merges"])
    ids = {t: i for i, t in enumerate(meta["tokens"])}
    for token, add in ((tok.bos_token, w.add_bos_token_id), (tok.eos_token, w.add_eos_token_id),
                       (tok.pad_token, w.add_pad_token_id)):
        if token in ids:
            add(ids[token])
    w.add_add_bos_token(_adds_bos(model_dir))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def _adds_bos(model_dir: Path) -> bool:
    cfg = model_dir / "tokenizer_config.json"
    return bool(cfg.is_file() and json.loads(cfg.read_text(encoding="utf-8")).get("add_bos_token"))


def folder_name(model_dir: Path) -> str:
    """A model folder's name; a run's ``final/`` is named after the run."""
    d = model_dir.resolve()
    return d.parent.name if d.name == "final" else d.name


def model_name(model_dir: Path, spec: ModelSpec) -> str:
    """``general.name``: :func:`folder_name`.

    llama.cpp stores Mistral as the llama architecture, and transformers and our importer
    tell it apart by "mistral" in the name.
    """
    name = folder_name(model_dir)
    if spec.model_type == "mistral" and "mistral" not in name.lower():
        name = f"mistral-{name}"
    return name


def export_gguf(model_dir: Path | str, out: Path | str, kind: str = "bf16",
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the model folder ``model_dir`` as the GGUF file ``out`` (which must not exist)."""
    model_dir, out = Path(model_dir), Path(out)
    if kind not in TYPES:
        raise UserError("--type", f"{kind!r} is not a GGUF export type", f"choose one of {', '.join(TYPES)}")
    if out.exists():
        raise UserError(out, "exists", "choose another --out, or move the old file away first")
    spec = load_spec(model_dir)
    Checkpoint(model_dir).check(spec)
    planned = plan(spec, kind)  # a family without a GGUF conversion: refused here
    archs.check(spec, model_dir)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch_name(spec.model_type))
    _write_metadata(w, spec, model_dir, model_name(model_dir, spec), kind)
    extra = archs.extra_tensors(spec)
    for p in planned:
        bshape, dtype, nbytes = _byte_shape(p.shape, p.qtype)
        w.add_tensor_info(p.gguf, bshape, np.dtype(dtype), nbytes,
                          raw_dtype=None if p.qtype in (Q.F32, Q.F16) else p.qtype)
    for name, data in extra.items():
        w.add_tensor_info(name, data.shape, np.dtype(np.float32), data.nbytes)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, data in enumerate(_tensors(model_dir, spec, planned)):
            w.write_tensor_data(data)
            if progress is not None:
                progress(i + 1, len(planned))
        for data in extra.values():
            w.write_tensor_data(data)
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out

