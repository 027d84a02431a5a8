"""A PEFT LoRA adapter folder -> a GGUF LoRA adapter, as llama.cpp loads it (``--lora FILE``;
Ollama: ``ADAPTER FILE`` in a Modelfile whose FROM is the base model).

What llama.cpp reads (src/llama-adapter.cpp): ``general.type = "adapter"``,
``general.architecture`` equal to the base model's, ``adapter.type = "lora"`` and
``adapter.lora.alpha`` (f32); then, for each adapted matrix ``N`` of the base GGUF
(``blk.0.attn_q.weight``), the tensors ``N.lora_a`` and ``N.lora_b``. Their ggml shapes are
``[in, r]`` and ``[r, out]`` for a base matrix of ``[in, out]``, i.e. PEFT's own ``A`` (r, in) and
``B`` (out, r) as numpy arrays. llama.cpp scales ``B @ A`` by ``alpha / r`` (r: ``lora_b``'s first
ggml dimension).

Two things the base model's conversion changes are carried over:

- llama's q and k rows are reordered in GGUF (:func:`~slideformer.engine.gguf.transforms.to_gguf_order`,
  a row permutation ``P``): ``P (B A) = (P B) A``, so only ``B``'s rows are reordered;
- rsLoRA scales by ``alpha / sqrt(r)``: ``alpha * sqrt(r)`` is written, which llama.cpp's
  ``alpha / r`` turns back into the trained scale.

The folder is read and checked against its base by
:func:`~slideformer.engine.generate.adapter.read_adapter` (as chat reads it).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np

from slideformer.engine.errors import UserError
from slideformer.engine.generate.adapter import Adapter, read_adapter
from slideformer.engine.gguf import archs
from slideformer.engine.gguf.exporter import TYPES, convert, tensor_type
from slideformer.engine.gguf.names import arch_name, tensor_names
from slideformer.engine.gguf.transforms import qk_heads, to_gguf_order
from slideformer.engine.models.lora import PROJECTIONS, LoraSpec, layer_targets
from slideformer.engine.models.weights import hf_name


def lora_scale_alpha(lora: LoraSpec) -> float:
    """``adapter.lora.alpha``: what llama.cpp divides by the rank to get the trained scale."""
    return lora.alpha * math.sqrt(lora.rank) if lora.rslora else lora.alpha


def export_lora_gguf(adapter_dir: Path | str, out: Path | str, kind: str = "f32",
                     base_dir: Path | str | None = None) -> Path:
    """Write the PEFT adapter in ``adapter_dir`` as the GGUF LoRA adapter ``out`` (which must
    not exist). ``base_dir``: the base model folder (default: the adapter's
    ``base_model_name_or_path``), whose config.json names the GGUF tensors."""
    out = Path(out)
    if kind not in TYPES:
        raise UserError("--type", f"{kind!r} is not a GGUF export type",
                        f"choose one of {', '.join(TYPES)}")
    if out.exists():
        raise UserError(out, "exists", "choose another --out, or move the old file away first")
    adapter = read_adapter(adapter_dir, base_dir)
    pairs = _pairs(adapter)
    archs.check(adapter.spec, adapter.base)  # a base llama.cpp would compute otherwise
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch_name(adapter.spec.model_type))
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora_scale_alpha(adapter.lora))
    for name, (a, b) in pairs.items():
        for suffix, t in (("lora_a", a), ("lora_b", b)):
            qtype = tensor_type(name, t.shape, kind)
            w.add_tensor(f"{name}.{suffix}", convert(t, qtype),
                         raw_dtype=None if qtype in (gguf.GGMLQuantizationType.F32,
                                                     gguf.GGMLQuantizationType.F16) else qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _pairs(adapter: Adapter) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """GGUF base tensor name -> (A, B) in llama.cpp's layout, fp32, layer order."""
    spec, names, out = adapter.spec, tensor_names(adapter.spec), {}
    for i in range(spec.num_layers):
        for t in layer_targets(spec, adapter.lora, i):
            hf = hf_name(f"layer{i}", PROJECTIONS[t] + ".weight")
            if hf not in names:
                raise UserError(adapter.folder, f"adapts {hf}, which a {spec.model_type} GGUF "
                                "does not hold as one matrix", "export the merged model instead "
                                "(lora.export_merged)")
            a, b = (np.ascontiguousarray(x.numpy(), np.float32) for x in adapter.pair(i, t))
            if (heads := qk_heads(spec, hf)) is not None:
                b = to_gguf_order(b, heads)
            out[names[hf]] = (a, b)
    return out
