"""Export of adapter training: PEFT's adapter folder, and the base with the adapters merged.

The adapter folder is what ``peft.PeftModel.from_pretrained(base, folder)`` loads:
``adapter_config.json`` (PEFT's LoraConfig fields) and ``adapter_model.safetensors`` with
PEFT's tensor names (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``).
The merged folder is a plain Hugging Face model, ``W + s * B @ A`` per target projection,
written one item at a time by :func:`slideformer.engine.models.weights.write_hf_folder` (peak memory: one
layer plus one output shard).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from slideformer.engine.models.lora import PROJECTIONS, LoraSpec, layer_targets
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.models.weights import (TOKENIZER_FILES, hf_name, item_layout, item_names,
                                               publish_dir, staging_dir, stored_views,
                                               write_hf_folder)
from slideformer.engine.runtime.lora import adapter_name
from slideformer.engine.testhooks import pause_at

PEFT_PREFIX = "base_model.model."


def adapter_config(lora: LoraSpec, base_model: str) -> dict:
    """PEFT's adapter_config.json for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": list(lora.targets), "use_rslora": lora.rslora, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None}


def adapter_tensors(host, spec: ModelSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every adapter's master as ``dtype`` under PEFT's names."""
    out = {}
    for i in range(spec.num_layers):
        item = host[adapter_name(i)]
        for local, view in item.layout.views(item.master()).items():
            out[PEFT_PREFIX + hf_name(f"layer{i}", local)] = view.to(dtype).contiguous()
    return out


def write_adapter(out_dir: Path | str, host, spec: ModelSpec, lora: LoraSpec, base_model: str,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Write the PEFT adapter folder atomically, as :func:`write_hf_folder` writes a model
    (an existing ``out_dir`` stays whole until the new one is complete; a kill between its
    renames is repaired by the next export). The adapters are small: fp32 by default."""
    out_dir = Path(out_dir)
    tmp = staging_dir(out_dir)
    try:
        save_file(adapter_tensors(host, spec, dtype), str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        pause_at("adapter.file")
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(lora, base_model),
                                                            indent=2))
        for f in TOKENIZER_FILES:
            if (Path(base_model) / f).is_file():
                shutil.copy2(Path(base_model) / f, tmp / f)
        return publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def merged_item(host, spec: ModelSpec, lora: LoraSpec, name: str) -> torch.Tensor:
    """Item ``name`` of the merged model as one fp32 flat tensor: the base's weights, a layer's
    adapters folded in (W + s B A)."""
    flat = host[name].master()
    if name.startswith("layer"):
        weights = item_layout(spec, name).views(flat)
        item = host[adapter_name(int(name[5:]))]
        ad = item.layout.views(item.master())
        for t in layer_targets(spec, lora, int(name[5:])):
            w = PROJECTIONS[t]
            weights[w + ".weight"] += lora.scaling * (ad[w + ".lora_B.weight"]
                                                      @ ad[w + ".lora_A.weight"])
    return flat


def merged_tensors(host, spec: ModelSpec, lora: LoraSpec):
    """(checkpoint name, fp32 tensor) of the merged model, one item materialised at a time."""
    for name in item_names(spec):
        yield from stored_views(spec, name, item_layout(spec, name).views(
            merged_item(host, spec, lora, name)))
        pause_at("merged.item")


def write_merged(out_dir: Path | str, host, spec: ModelSpec, lora: LoraSpec, base_model: str,
                 dtype: torch.dtype, shard_bytes: int) -> Path:
    """The base with the adapters folded in, as a Hugging Face folder (atomic)."""
    out_dir = Path(out_dir)
    try:
        return write_hf_folder(out_dir, spec, merged_tensors(host, spec, lora), dtype=dtype,
                               max_shard_bytes=shard_bytes, tokenizer_dir=base_model)
    except BaseException:
        shutil.rmtree(out_dir.with_name(out_dir.name + ".partial"), ignore_errors=True)
        raise
