"""LoRA runs end to end on the CPU: the CLI, the PEFT adapter folder, the merged export, resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slideformer.engine.cli import main
from slideformer.engine.events import StepMetrics, read_events
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.train.commands import run_training
from test_train import TRAIN, step_losses

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


TASK = dict(arch="llama", shape=TinyShape(layers=3), seed=21, rows=200, validation=10)
"""This module's tiny model and data."""


@pytest.fixture(scope="module")
def lora_cfg(tiny_run):
    """``make(run_dir, method="lora", **train) -> RunConfig``: test_train's run training adapters
    on this module's model; ``train`` sets train.* keys."""
    def make(run_dir, method="lora", **train):
        return tiny_run(run_dir, {**TRAIN, "train.method": method,
                                  **{f"train.{k}": v for k, v in train.items()},
                                  "optim.lr": 2e-2, "lora.rank": 4, "lora.alpha": 8.0}, **TASK)
    return make


@pytest.fixture(scope="module")
def files(lora_cfg, tmp_path_factory):
    """(model folder, training data) of this module's runs."""
    cfg = lora_cfg(tmp_path_factory.mktemp("lora") / "run")
    return Path(cfg.model.path), Path(cfg.data.train)


def test_cli_lora_run_exports_an_adapter_peft_loads(files, tmp_path, capsys):
    """`slideformer train --set train.method=lora`: the final folder loads with
    PeftModel.from_pretrained onto the HF base with the logits of our merged export, which
    transformers loads on its own."""
    run = tmp_path / "run"
    args = ["train", "--model", str(files[0]), "--data", str(files[1]),
            "--run-dir", str(run), "--max-steps", "4", "--seq-len", "48", "--device", "cpu",
            "--lr", "2e-2", "--set", "train.method=\"lora\"", "--set", "lora.rank=4",
            "--set", "lora.export_merged=true", "--set", "lora.target_modules=\"q_proj,v_proj,down_proj\""]
    assert main(args) == 0
    assert "4/4 steps" in capsys.readouterr().out
    final = run / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(files[0], dtype=torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, final)(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            run / "final-merged", dtype=torch.float32)(input_ids=ids).logits
    assert not torch.allclose(adapted, plain, rtol=0, atol=1e-4)  # the adapters trained
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)
    from safetensors.torch import load_file
    keys = set(load_file(str(final / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 3 * 3 * 2


def test_resumed_lora_run_equals_uninterrupted(lora_cfg, tmp_path):
    """Checkpoints hold the adapters, their moments and the data position (not the base):
    stop at step 3, resume, and the losses and the adapters equal an uninterrupted run's."""
    from safetensors.torch import load_file
    from slideformer.engine.train.trainer import Trainer
    run_training(lora_cfg(tmp_path / "a"))
    cfg = lora_cfg(tmp_path / "b")
    t = Trainer(cfg, callbacks=[lambda ev: isinstance(ev, StepMetrics) and ev.step == 3 and t.stop(True)])
    t.setup()
    assert t.train() == "stopped"
    t.cleanup()
    ck = tmp_path / "b" / "checkpoints" / "step-3"
    assert not any("layer" in p.name or "embed" in p.name for p in ck.iterdir())  # no base
    assert run_training(cfg, resume=True) == "finished"
    la, lb = step_losses(tmp_path / "a"), step_losses(tmp_path / "b")
    assert la == lb and len(la) == 6
    wa = load_file(str(tmp_path / "a" / "final" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "final" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(isinstance(e, StepMetrics) for e in read_events(tmp_path / "b" / "events.jsonl"))


@pytest.mark.parametrize("key,value,needle", [
    ("train.method", "\"dora\"", "train.method"), ("lora.rank", "0", "lora.rank"),
    ("lora.target_modules", "\"q_proj,qkv\"", "lora.target_modules")])
def test_bad_lora_settings_are_one_clear_error(files, tmp_path, capsys, key, value, needle):
    args = ["train", "--model", str(files[0]), "--data", str(files[1]),
            "--run-dir", str(tmp_path / "r"), "--device", "cpu", "--set", "train.method=\"lora\"",
            "--set", f"{key}={value}"]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_qlora_run_trains_and_its_merged_export_is_base_nf4_plus_adapters(lora_cfg, files, tmp_path):
    """train.method = qlora: the decoder layers are NF4 on the host; the merged export is the
    dequantised base plus the adapters, with the logits PEFT gives on that base."""
    from slideformer.engine import config as config_mod
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.weights import write_hf_folder
    from slideformer.engine.runtime.backend import CpuBackend
    from slideformer.engine.models.lora import lora_spec
    from slideformer.engine.train.state import build_frozen_state, load_weights, master_tensors
    cfg = config_mod.override(lora_cfg(tmp_path / "q", method="qlora"),
                              {"lora.export_merged": True, "train.max_steps": 3})
    assert run_training(cfg) == "finished"
    spec = load_spec(files[0])
    host = build_frozen_state(spec, CpuBackend(), torch.float32, torch.float32,
                              lora_spec(cfg.lora), nf4=True)
    load_weights(host, spec, files[0])
    deq = write_hf_folder(tmp_path / "deq", spec, master_tensors(host, spec), dtype=torch.float32,
                          tokenizer_dir=files[0])
    base = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "q" / "final")(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "q" / "final-merged", dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-5)
