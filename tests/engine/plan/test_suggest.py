"""Suggested first settings: the first method the planner says fits, the example recipes'
learning rate and rank, and the largest micro-batch that fits toward 16K tokens per step
(public configs on an RTX 4090 preset with the host RAM given)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slideformer.engine.config import RunConfig, override
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan.planner import fit_verdict, plan_run, resolve_machine
from slideformer.engine.plan.suggest import LEARNING_RATES, TOKENS_PER_STEP, suggest

FIXTURES = Path(__file__).parents[2] / "fixtures" / "configs"


def folder(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(FIXTURES / f"{name}.json", d / "config.json")
    return d


@pytest.mark.parametrize("name, ram, method", [
    ("llama-3.2-3b", "64GiB", "full"),
    ("llama-3.1-8b", "64GiB", "lora"),
    ("llama-3.1-8b", "256GiB", "full"),
    ("llama-3.1-70b", "64GiB", "qlora"),
])
def test_the_first_method_that_fits_with_a_batch_that_fits(tmp_path, name, ram, method):
    spec = load_spec(folder(tmp_path, name))
    cfg = override(RunConfig(), {"budget.ram": ram})
    s = suggest(cfg, spec, "rtx4090")
    v = s.values
    assert v["train.method"] == method and v["optim.lr"] == LEARNING_RATES[method]
    assert ("lora.rank" in v) == (method != "full")
    # every method before it does not fit even one sequence per step, by the planner's verdict
    one = {**v, "train.micro_batch": 1, "train.grad_accum": 1}
    machine = resolve_machine(override(cfg, one), "rtx4090")
    order = ["full", "lora", "qlora"]
    for earlier in order[:order.index(method)]:
        verdict, why = fit_verdict(override(cfg, {**one, "train.method": earlier}), spec, machine)
        assert verdict == "does not fit" and why in " ".join(s.reasons)
    plan = plan_run(override(cfg, one), spec, machine.device, machine.hardware)
    micro, accum, seq = v["train.micro_batch"], v["train.grad_accum"], v["data.max_seq_len"]
    assert seq == 2048 and 1 <= micro <= plan.max_micro_batch
    assert micro * accum * seq >= TOKENS_PER_STEP > micro * (accum - 1) * seq
    assert s.verdict == plan_run(override(cfg, v), spec, machine.device, machine.hardware).verdict


def test_a_short_context_caps_the_sequence(tmp_path):
    d = folder(tmp_path, "llama-3.2-3b")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512}))
    s = suggest(RunConfig(), load_spec(d), "rtx4090")
    assert s.values["data.max_seq_len"] == 512 and "the model's context" in s.reasons[0]


def test_plan_suggest_prints_tables_the_config_reads(tmp_path):
    d = folder(tmp_path, "llama-3.1-8b")
    out = subprocess.run([sys.executable, "-m", "slideformer.engine.cli", "plan", "--model", str(d),
                          "--gpu", "rtx4090", "--ram", "64GiB", "--suggest", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["settings"]["train.method"] == "lora" and got["plan"]["method"] == "lora"
    text = subprocess.run([sys.executable, "-m", "slideformer.engine.cli", "plan", "--model", str(d),
                           "--gpu", "rtx4090", "--ram", "64GiB", "--suggest"],
                          capture_output=True, text=True, timeout=300).stdout
    toml = text.split("\n\n", 1)[1].split("model: ")[0]
    from slideformer.engine import config as config_mod
    cfg = config_mod.from_dict(config_mod.tomllib.loads(toml), "suggested")
    assert cfg.train.method == "lora" and cfg.lora.rank == got["settings"]["lora.rank"]
