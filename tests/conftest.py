"""Shared fixtures.

Model folders and data files handed out here are built once per session and shared between tests:
treat them as read-only, and copy one (``shutil.copytree``) before breaking it on purpose.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.models.model import DenseModel
from slideformer.engine.models.spec import SUPPORTED, load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.models.weights import Checkpoint
from slideformer.engine.train.demo import write_task


@pytest.fixture
def one_torch_thread():
    """Tiny models' matmuls on one OpenMP thread: on a busy two-core machine, waking a second
    thread made a (16, 96) x (96, 160) matmul take 0.1-4 ms instead of 9 us (measured), which
    made a test file's run time swing from 3 to 90 s. Results are compared within one setting.
    Modules that need it say ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- tiny model folders ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(arch, shape=TinyShape(), extra_config=None, seed=0) -> folder``, each built once."""
    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", shape: TinyShape = TinyShape(), extra_config: dict | None = None,
             seed: int = 0) -> Path:
        key = (arch, shape, json.dumps(extra_config, sort_keys=True), seed)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
            built[key] = make_tiny_model(out, arch, shape, seed, extra_config=extra_config)
        return built[key]

    return make


@pytest.fixture(scope="session", params=SUPPORTED)
def tiny_model(request, tiny_model_factory) -> Path:
    """A tiny model folder (default odd shape) of each supported family, in turn."""
    return tiny_model_factory(request.param)


@pytest.fixture(scope="session")
def bnb4_folder_factory(tmp_path_factory):
    """``make(src, shard="5GB", **BitsAndBytesConfig kwargs) -> folder``: the model folder
    ``src`` saved in 4 bits by transformers itself (from_pretrained with the config on the CPU,
    then save_pretrained), so the names and quant states are those of the *-bnb-4bit releases;
    default NF4 with double quantisation; shards of at most ``shard``; tokenizer copied."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("accelerate")  # transformers' bitsandbytes loader requires it
    from transformers.utils import logging

    from slideformer.engine.models.weights import TOKENIZER_FILES
    logging.disable_progress_bar()
    built: dict[str, Path] = {}

    def make(src: Path, shard: str = "5GB", **kw) -> Path:
        kw = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, **kw}
        key = repr((str(src), shard, sorted(kw.items())))
        if key not in built:
            q = transformers.BitsAndBytesConfig(load_in_4bit=True, **kw,
                                                bnb_4bit_compute_dtype=torch.bfloat16)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                src, quantization_config=q, device_map="cpu", dtype=torch.bfloat16)
            out = tmp_path_factory.mktemp("bnb4") / "model"
            model.save_pretrained(out, max_shard_size=shard)
            for f in TOKENIZER_FILES:
                if (src / f).is_file():
                    shutil.copy2(src / f, out / f)
            built[key] = out
        return built[key]

    return make


# ---- tiny training runs ------------------------------------------------------------------------
SMALL = TinyShape(layers=3, hidden=32, heads=2, kv_heads=1, intermediate=48)
"""The default model of a tiny run: three layers, a few thousand parameters each."""
RUN = {"data.max_seq_len": 32, "optim.lr": 2e-3, "optim.warmup_steps": 2,
       "optim.weight_decay": 0.01, "train.micro_batch": 2, "train.max_steps": 6,
       "train.device": "cpu", "budget.slots": 2}
"""The settings of a tiny run that its overrides start from."""


@pytest.fixture(scope="session")
def tiny_run(tiny_model_factory, tmp_path_factory):
    """``make(run_dir, over=None, *, arch="llama", shape=SMALL, seed=3, rows=200, validation=0)
    -> RunConfig``: a CPU run of a tiny model on the demo task (engine.train.demo).

    ``over`` maps dotted config keys to values (``{"train.max_steps": 4}``), applied over
    :data:`RUN`; ``seed`` seeds the model's weights; ``rows`` and ``validation`` are the training
    and validation records (seeds 1 and 2; 0 validation rows: no validation file). The model
    folder and the data files are built once per session (read-only: see the module docstring).
    """
    tasks: dict[tuple[int, int], Path] = {}
    root = tmp_path_factory.mktemp("tiny-tasks")

    def task(rows: int, seed: int) -> Path:
        if (rows, seed) not in tasks:
            tasks[rows, seed] = root / f"task-{rows}-{seed}.jsonl"
            write_task(tasks[rows, seed], rows, seed)
        return tasks[rows, seed]

    def make(run_dir: Path, over: dict | None = None, *, arch: str = "llama",
             shape: TinyShape = SMALL, seed: int = 3, rows: int = 200,
             validation: int = 0) -> config_mod.RunConfig:
        data: dict = {"model": {"path": str(tiny_model_factory(arch, shape, seed=seed))},
                      "data": {"train": str(task(rows, 1))}, "output": {"run_dir": str(run_dir)}}
        if validation:
            data["data"]["validation"] = str(task(validation, 2))
        for key, value in {**RUN, **(over or {})}.items():
            section, _, name = key.partition(".")
            data.setdefault(section, {})[name] = value
        return config_mod.from_dict(data)

    return make


# ---- loaders -----------------------------------------------------------------------------------
def _load_dense(model_dir: Path, dtype: torch.dtype = torch.float32) -> DenseModel:
    spec = load_spec(model_dir)
    model = DenseModel(spec, dtype=dtype)
    ckpt = Checkpoint(model_dir)
    with torch.no_grad():
        for item, flat, _ in model.items():
            ckpt.read_item(spec, item, flat)
    ckpt.close()
    return model


def _load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    # eager attention: the reference should not share our SDPA path; eager experts: a loop
    # over the experts, not transformers' default grouped_mm (another summation order, which
    # the SDPA noise run of test_family_training does not share)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager",
                                                experts_implementation="eager").eval()


@pytest.fixture(scope="session")
def load_dense():
    """``load(model_dir, dtype=float32) -> DenseModel`` with the folder's weights."""
    return _load_dense


@pytest.fixture(scope="session")
def load_hf():
    """``load(model_dir) -> transformers model`` (fp32, eager attention, eval mode)."""
    return _load_hf


# ---- a stand-in for Ollama's command line -----------------------------------------------------
@pytest.fixture
def fake_ollama(tmp_path, monkeypatch):
    """``install(body='echo success') -> record``: puts an ``ollama`` shell script first on PATH
    that writes its arguments, one a line, to ``record`` and then runs ``body``; ``install(None)``
    leaves no ``ollama`` on PATH at all."""
    if os.name != "posix":
        pytest.skip("the fake ollama is a shell script")

    def install(body: str | None = 'echo "success"') -> Path:
        bin_dir, record = tmp_path / "fake-bin", tmp_path / "ollama-args.txt"
        if body is None:
            (tmp_path / "empty-bin").mkdir(exist_ok=True)
            monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
            return record
        bin_dir.mkdir(exist_ok=True)
        exe = bin_dir / "ollama"
        exe.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{record}'\n{body}\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return record

    return install
