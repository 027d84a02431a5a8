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

- llama's q and k rows are reordered in GGUF (:func:`~slideformer.engine.gguf.names.to_gguf_order`,
  a row permutation ``P``): ``P (B A) = (P B) A``, so only ``B``'s rows are reordered;
- rsLoRA scales by ``alpha / sqrt(r)``: ``alpha * sqrt(r)`` is written, which llama.cpp's
  ``alpha / r`` turns back into the trained scale.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.exporter import TYPES, convert, tensor_type
from slideformer.engine.gguf.names import arch_name, qk_heads, tensor_names, to_gguf_order
from slideformer.engine.jsonfile import read_json
from slideformer.engine.models.spec import ModelSpec, load_spec
from slideformer.engine.train.lora_export import PEFT_PREFIX

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_FIX = "use the adapter folder a LoRA run wrote (its final/), unchanged"


def is_adapter(folder: Path | str) -> bool:
    """Whether ``folder`` is a PEFT adapter folder (an adapter_config.json in it)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def lora_scale_alpha(cfg: dict) -> float:
    """``adapter.lora.alpha``: what llama.cpp divides by the rank to get the trained scale."""
    rank, alpha = cfg["r"], float(cfg["lora_alpha"])
    return alpha * math.sqrt(rank) if cfg.get("use_rslora") else alpha


def export_lora_gguf(adapter_dir: Path | str, out: Path | str, kind: str = "f32",
                     base_dir: Path | str | None = None) -> Path:
    """Write the PEFT adapter in ``adapter_dir`` as the GGUF LoRA adapter ``out`` (which must
    not exist). ``base_dir``: the base model folder (default: the adapter's
    ``base_model_name_or_path``), whose config.json names the GGUF tensors."""
    adapter_dir, out = Path(adapter_dir), Path(out)
    if kind not in TYPES:
        raise UserError("--type", f"{kind!r} is not a GGUF export type",
                        f"choose one of {', '.join(TYPES)}")
    if out.exists():
        raise UserError(out, "exists", "choose another --out, or move the old file away first")
    cfg = _config(adapter_dir)
    spec = load_spec(_base(adapter_dir, cfg, base_dir))
    pairs = _pairs(adapter_dir, spec)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch_name(spec.model_type))
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora_scale_alpha(cfg))
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


def _config(adapter_dir: Path) -> dict:
    path = adapter_dir / ADAPTER_CONFIG
    cfg = read_json(path, _FIX)
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise UserError(path, "is not a PEFT LoRA config (peft_type is not LORA)", _FIX)
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool):
            raise UserError(path, f"has no number '{key}'", _FIX)
    return cfg


def _base(adapter_dir: Path, cfg: dict, base_dir: Path | str | None) -> Path:
    base = Path(base_dir) if base_dir else Path(str(cfg.get("base_model_name_or_path") or ""))
    if not (base / "config.json").is_file():
        raise UserError(adapter_dir / ADAPTER_CONFIG, f"names the base model {str(base)!r}, "
                        "which is not a model folder here",
                        "give the base model's folder (--base), the one the adapter was trained on")
    return base


def _pairs(adapter_dir: Path, spec: ModelSpec) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """GGUF base tensor name -> (A, B) in llama.cpp's layout, fp32, layer order."""
    path = adapter_dir / ADAPTER_WEIGHTS
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise UserError(path, f"cannot be read ({e})", _FIX) from None
    names = tensor_names(spec)
    out = {}
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        hf = key.removeprefix(PEFT_PREFIX).replace(".lora_A.weight", ".weight")
        b_key = key.replace(".lora_A.weight", ".lora_B.weight")
        if hf not in names or b_key not in tensors:
            raise UserError(path, f"holds {key}, which adapts no matrix of the base model "
                            f"(or has no lora_B)", "give the base model the adapter was trained "
                            "on (--base)")
        a, b = (np.ascontiguousarray(tensors[k], np.float32) for k in (key, b_key))
        if (heads := qk_heads(spec, hf)) is not None:
            b = to_gguf_order(b, heads)
        out[names[hf]] = (a, b)
    if not out:
        raise UserError(path, "holds no lora_A / lora_B tensors", _FIX)
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]), name) if parts[0] == "blk" else (-1, name)
