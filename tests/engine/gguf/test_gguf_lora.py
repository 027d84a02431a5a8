"""PEFT LoRA adapters as GGUF LoRA adapters: read back, each tensor against the PEFT adapter.

Two references: the PEFT tensors themselves (``lora_a`` is A as is; ``lora_b`` is B, its rows in
llama.cpp's q/k order where the base is stored so), and the full-model export: the GGUF of the
base with ``s * B @ A`` merged in, less the GGUF of the base, must equal what llama.cpp adds,
``alpha / r * lora_b @ lora_a`` in the base GGUF's own tensor layout.
"""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from slideformer.engine.cli import main
from slideformer.engine.errors import UserError
from slideformer.engine.gguf.exporter import export_gguf
from slideformer.engine.gguf.lora_adapter import export_lora_gguf
from slideformer.engine.gguf.names import tensor_names
from slideformer.engine.models.lora import PROJECTIONS, LoraSpec
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.weights import hf_name
from slideformer.engine.train.lora_export import PEFT_PREFIX, adapter_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(folder, base, lora: LoraSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random PEFT adapter of ``base`` (B non-zero, unlike a fresh one), as LoRA runs write it."""
    spec, g = load_spec(base), torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(spec.num_layers):
        for t in lora.targets:
            out, inp = spec.layer_layout.shape(PROJECTIONS[t] + ".weight")
            name = PEFT_PREFIX + hf_name(f"layer{i}", PROJECTIONS[t])
            tensors[f"{name}.lora_A.weight"] = torch.randn(lora.rank, inp, generator=g)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, lora.rank, generator=g) * 0.1
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config(lora, str(base))))
    return tensors


def merged_folder(base, out, tensors: dict[str, torch.Tensor], scale: float):
    """``base`` with ``scale * B @ A`` added to each adapted matrix, in fp32."""
    shutil.copytree(base, out)
    weights = {k: v.float() for k, v in load_file(str(base / "model.safetensors")).items()}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            b = tensors[key.replace("lora_A", "lora_B")]
            weights[key.removeprefix(PEFT_PREFIX).replace(".lora_A", "")] += scale * (b @ a)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "float32"}))
    return out


def gguf_tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def field(reader: gguf.GGUFReader, key: str):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0]


@pytest.mark.parametrize("arch,rslora", [("llama", False), ("qwen2", True)])
def test_lora_gguf_against_the_peft_adapter(tiny_model_factory, tmp_path, arch, rslora):
    base = tiny_model_factory(arch, TinyShape(layers=2), seed=5)
    lora = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=TARGETS, rslora=rslora)
    peft = write_peft_adapter(tmp_path / "run" / "final", base, lora)
    assert main(["export-gguf", str(tmp_path / "run" / "final"), "--type", "f32"]) == 0
    out = tmp_path / "run" / "run-lora-f32.gguf"
    reader = gguf.GGUFReader(out)
    assert (field(reader, "general.type"), field(reader, "adapter.type")) == ("adapter", "lora")
    assert field(reader, "general.architecture") == gguf.MODEL_ARCH_NAMES[
        {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]]
    alpha = field(reader, "adapter.lora.alpha")
    assert alpha / lora.rank == pytest.approx(lora.scaling)  # llama.cpp's scale: alpha / r

    spec, adapter = load_spec(base), gguf_tensors(out)
    full_base = gguf_tensors(export_gguf(base, tmp_path / "base.gguf", "f32"))
    merged = merged_folder(base, tmp_path / "merged", peft, lora.scaling)
    full_merged = gguf_tensors(export_gguf(merged, tmp_path / "merged.gguf", "f32"))
    names = tensor_names(spec)
    assert len(adapter) == len(peft) == 2 * spec.num_layers * len(TARGETS)
    for key in peft:
        if not key.endswith(".lora_A.weight"):
            continue
        hf = key.removeprefix(PEFT_PREFIX).replace(".lora_A", "")
        n = names[hf]
        a, b, w = adapter[f"{n}.lora_a"], adapter[f"{n}.lora_b"], full_base[n]
        # llama-adapter.cpp's shape checks, in ggml's dimension order
        assert a.shape[0] == w.shape[0] and b.shape[1] == w.shape[1] and a.shape[1] == b.shape[0]
        assert np.array_equal(a.data, peft[key].numpy())
        b_peft = peft[key.replace("lora_A", "lora_B")].numpy()
        permuted = arch == "llama" and (".q_proj." in hf or ".k_proj." in hf)
        assert np.array_equal(b.data, b_peft) != permuted  # q/k rows reordered for llama only
        assert np.array_equal(np.sort(b.data, axis=0), np.sort(b_peft, axis=0))
        delta = full_merged[n].data.astype(np.float64) - w.data.astype(np.float64)
        expect = alpha / lora.rank * (b.data.astype(np.float64) @ a.data.astype(np.float64))
        np.testing.assert_allclose(delta, expect, atol=2e-5, err_msg=n)


def test_lora_gguf_bad_inputs(tiny_model_factory, tmp_path):
    base = tiny_model_factory("llama", TinyShape(layers=2), seed=5)
    lora = LoraSpec(rank=2, alpha=4.0, dropout=0.0, targets=("q_proj",))
    folder = tmp_path / "adapter"
    write_peft_adapter(folder, base, lora)
    with pytest.raises(UserError, match="not a model folder here"):
        export_lora_gguf(folder, tmp_path / "a.gguf", "f32", base_dir=tmp_path / "nowhere")
    other = tiny_model_factory("llama", TinyShape(layers=1), seed=5)  # fewer layers
    with pytest.raises(UserError, match="adapts no matrix of the base model"):
        export_lora_gguf(folder, tmp_path / "b.gguf", "f32", base_dir=other)
    assert main(["export-gguf", str(folder), "--ollama", "x"]) == 2
    assert not any(tmp_path.glob("*.gguf"))
