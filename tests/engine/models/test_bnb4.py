"""Pre-quantised bitsandbytes 4-bit folders (``*-bnb-4bit``): read as stored, against bitsandbytes
and transformers.

The folders are written by transformers itself (``from_pretrained`` with a BitsAndBytesConfig on
the CPU, then ``save_pretrained``), so the tensor names and the quant-state blobs are the ones
the *-bnb-4bit releases carry, not our reading of them.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from safetensors.torch import load_file, save_file  # noqa: E402

from slideformer.engine import config as config_mod  # noqa: E402
from slideformer.engine.cli import main  # noqa: E402
from slideformer.engine.events import Log, StepMetrics, read_events  # noqa: E402
from slideformer.engine.models.lora import lora_spec  # noqa: E402
from slideformer.engine.models.model import DenseModel  # noqa: E402
from slideformer.engine.models.spec import load_spec  # noqa: E402
from slideformer.engine.models.tiny import TinyShape  # noqa: E402
from slideformer.engine.models.weights import Checkpoint, hf_name  # noqa: E402
from slideformer.engine.runtime.backend import CpuBackend  # noqa: E402
from slideformer.engine.train.commands import run_training  # noqa: E402
from slideformer.engine.train.state import build_frozen_state, load_weights  # noqa: E402

SHAPE = TinyShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=320)
"""Odd counts of blocks: up_proj's 320 blocks of 64 leave a partial block of second-level
scales (256 + 64)."""
IDS = torch.randint(0, SHAPE.vocab, (2, 15), generator=torch.Generator().manual_seed(0))
RUN = {"train.method": "qlora", "lora.rank": 4, "lora.alpha": 8.0, "optim.lr": 2e-2,
       "train.max_steps": 3, "lora.export_merged": True}


@pytest.fixture(scope="module")
def bnb_folder(bnb4_folder_factory, tiny_model_factory):
    """``make(shard="5GB", **BitsAndBytesConfig kwargs) -> folder``: this module's tiny model
    in 4 bits (tests/conftest.py: bnb4_folder_factory)."""
    src = tiny_model_factory("llama", SHAPE, seed=5)
    return lambda **kw: bnb4_folder_factory(src, **kw)


def stored_state(tensors: dict, name: str):
    """bitsandbytes' own QuantState of a stored weight, parsed by bitsandbytes (the reference)."""
    parts = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
    return bnb.functional.QuantState.from_dict(parts, device="cpu")


def quantised_names(spec):
    return [(i, local) for i in range(spec.num_layers)
            for local, _, shape in spec.layer_layout.entries if len(shape) > 1]


def test_qlora_state_holds_the_stored_bytes_and_dequantises_as_bitsandbytes(bnb_folder):
    """The NF4 layers hold the folder's codes, absmax codes, second-level scales and offset as
    stored, and dequantise to bitsandbytes' dequantize_4bit of the stored weights exactly; the
    1-D tensors and the unquantised embedding and head are the stored bf16 values."""
    folder = bnb_folder()
    spec, tensors = load_spec(folder), load_file(str(folder / "model.safetensors"))
    host = qlora_state(folder)
    for i, local in quantised_names(spec):
        name, item = hf_name(f"layer{i}", local), host[f"layer{i}"]
        t = next(t for t in item.quant.tensors if t.name == local)
        codes, qabs, scales = item.quant.parts(item.w, t)
        st = stored_state(tensors, name)
        assert torch.equal(codes, tensors[name].view(-1)) and torch.equal(qabs, st.absmax), name
        assert torch.equal(scales[:-1], st.state2.absmax) and scales[-1] == st.offset, name
        st.dtype = torch.float32  # the reference in fp32, the dtype of our master
        ref = bnb.functional.dequantize_4bit(tensors[name], st)
        assert torch.equal(item.quant.layout.views(item.master())[local], ref), name
    for name in ("layer0", "embed", "head"):
        item = host[name]
        for local, v in item.layout.views(item.master()).items():
            if v.dim() == 1 or item.quant is None:
                assert torch.equal(v, tensors[hf_name(name, local)].float()), local


def qlora_state(folder):
    spec = load_spec(folder)
    host = build_frozen_state(spec, CpuBackend(), torch.float32, torch.float32,
                              lora_spec(config_mod.LoraConfig()), nf4=True)
    load_weights(host, spec, folder)
    return host


@pytest.mark.parametrize("how", [{"shard": "40KB"}, {"bnb_4bit_quant_storage": torch.bfloat16}])
def test_sharded_and_bf16_stored_folders_load_the_same_bytes(how, bnb_folder):
    """Weights and their parts spread over shards (an index), or codes stored as bf16 (FSDP's
    quant storage, the same bytes), load into the same NF4 state as the one-file uint8 folder."""
    folder = bnb_folder(**how)
    codes = Checkpoint(folder).meta["model.layers.0.mlp.up_proj.weight"]
    assert (folder / "model.safetensors.index.json").is_file() == ("shard" in how)
    assert codes["dtype"] == ("U8" if "shard" in how else "BF16")
    ours, ref = qlora_state(folder), qlora_state(bnb_folder())
    for name, item in ref.items():
        if name.startswith("layer"):
            assert torch.equal(ours[name].w, item.w), name


def test_dense_logits_equal_transformers_on_its_dequantised_weights(bnb_folder, load_hf):
    """Read as bf16 (the GPU's compute dtype), every weight is transformers' dequantize() of
    the folder bit for bit, and the logits of our forward are transformers' on those weights."""
    folder = bnb_folder()
    spec = load_spec(folder)
    ours, ckpt = DenseModel(spec), Checkpoint(folder)
    with torch.no_grad():
        for item, flat, _ in ours.items():
            flat.copy_(ckpt.read_item(spec, item, torch.empty(flat.numel(), dtype=torch.bfloat16)))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, device_map="cpu", dtype=torch.float32, attn_implementation="eager").dequantize()
    ref_params = dict(ref.named_parameters())
    for i, local in quantised_names(spec):
        w = spec.layer_layout.views(ours.layers[i])[local]
        assert torch.equal(w, ref_params[hf_name(f"layer{i}", local)].float()), local
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(IDS), ref.float()(input_ids=IDS).logits,
                                   rtol=1e-4, atol=1e-5)


def test_info_names_the_format(bnb_folder, capsys):
    assert main(["info", str(bnb_folder()), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_dtype"] == "pre-quantised NF4 (bitsandbytes)"


def test_adapter_runs_on_a_bnb_folder_and_peft_loads_the_adapter_on_the_4_bit_base(
        bnb_folder, tiny_run, tmp_path):
    """qlora uses the stored NF4 bytes, lora dequantises them (the log says which): on the CPU
    in fp32 both train on the same base values, so their losses and adapters are equal. The
    exported adapter loads with PEFT onto transformers' 4-bit model of the folder, whose
    logits are our merged export's up to the bf16 rounding bitsandbytes computes in (its
    compute dtype), and far from the base's."""
    folder, runs, losses = bnb_folder(), {}, {}
    for method in ("qlora", "lora"):
        runs[method] = run = tmp_path / method
        cfg = tiny_run(run, {**RUN, "train.method": method}, shape=SHAPE)
        assert run_training(config_mod.override(cfg, {"model.path": str(folder)})) == "finished"
        events = read_events(run / "events.jsonl")
        losses[method] = [e.loss for e in events if isinstance(e, StepMetrics)]
        logs = [e.message for e in events if isinstance(e, Log)]
        how = "copied as stored" if method == "qlora" else "dequantised while loading"
        assert any("pre-quantised NF4 (bitsandbytes)" in m and how in m for m in logs), logs
    assert losses["qlora"] == losses["lora"] and len(losses["lora"]) == 3
    a, b = (load_file(str(runs[m] / "final" / "adapter_model.safetensors")) for m in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu",
                                                             dtype=torch.float32)
    # PEFT wraps the 4-bit layers before any forward: bitsandbytes repacks a CPU layer's codes
    # at its first forward without gradients, which the wrapped layer then cannot read
    model = peft.PeftModel.from_pretrained(base, runs["qlora"] / "final")
    with torch.no_grad():
        adapted = model(input_ids=IDS).logits.float()
        with model.disable_adapter():
            plain = model(input_ids=IDS).logits.float()
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            runs["qlora"] / "final-merged", dtype=torch.float32)(input_ids=IDS).logits
    torch.testing.assert_close(adapted, merged, rtol=0, atol=2e-2)
    assert (adapted - merged).abs().max() < 0.05 * (adapted - plain).abs().max()


# ---- bad folders: one error naming the file and the tensor -----------------------------------
def without(folder: Path, tmp_path: Path, key: str) -> Path:
    """A copy of ``folder`` whose weights lack the tensor ``key``."""
    out = tmp_path / "broken"
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors[key]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_missing_absmax_is_one_clear_error(bnb_folder, tmp_path, capsys):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = without(bnb_folder(), tmp_path, name + ".absmax")
    assert main(["info", str(folder)]) != 0
    err = capsys.readouterr().err
    assert str(folder / "model.safetensors") in err and f"'{name}.absmax' is missing" in err
    assert "Traceback" not in err and "fix:" in err


@pytest.mark.parametrize("kw,problem", [
    ({"bnb_4bit_quant_type": "fp4"}, "is quantised as FP4"),
    ({"bnb_4bit_use_double_quant": False}, "without double quantisation")])
def test_other_4_bit_variants_are_refused_by_name(kw, problem, bnb_folder, tiny_run, tmp_path,
                                                  capsys):
    """A run on an FP4 or a single-quantised folder stops before loading, naming the shard,
    a quantised tensor and what is unsupported."""
    folder = bnb_folder(**kw)
    args = ["train", "--model", str(folder), "--data", tiny_run(tmp_path / "x").data.train,
            "--run-dir", str(tmp_path / "run"), "--device", "cpu",
            "--set", "train.method=\"qlora\""]
    assert main(args) != 0
    err = capsys.readouterr().err
    shard = re.escape(str(folder / "model.safetensors"))
    assert re.search(rf"{shard}: tensor 'model\.layers\.0\.\S+\.weight' (is NF4 )?{problem}", err), err
    assert "Traceback" not in err and err.count("error:") == 1


@pytest.mark.parametrize("part,change,problem", [
    (".quant_map", lambda t: t * 0.5, "is not NF4"),
    (".nested_absmax", lambda t: t.index_fill(0, torch.tensor([0]), float("nan")), "holds 1 NaN")])
def test_a_foreign_table_or_a_nan_scale_is_refused_when_read(part, change, problem, bnb_folder,
                                                              tmp_path):
    """A quant_map that is not NF4 (the codes would mean other values) or a NaN second-level
    scale is refused by name as the weights load."""
    from slideformer.engine.errors import UserError
    name = "model.layers.0.mlp.down_proj.weight"
    folder = tmp_path / "changed"
    shutil.copytree(bnb_folder(), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name + part] = change(tensors[name + part])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    spec = load_spec(folder)
    Checkpoint(folder).check(spec)  # the headers and quant states are sound
    with pytest.raises(UserError, match=rf"tensor '{re.escape(name + part)}' {problem}"):
        Checkpoint(folder).read_item(spec, "layer0", torch.empty(spec.params_per_layer))
