"""LoRA adapter folder fuzzing: adapter_config.json's keys set to any JSON value or deleted
(ranks, alphas, targets the base lacks, bases that are missing or another model, DoRA and other
PEFT methods), the file replaced; the weights missing, cut short, pickled, with tensors dropped,
added, transposed, of another rank or dtype, NaN (adapter_fuzz's hypothesis strategies), through
both readers of an adapter folder: ``slideformer chat`` (the adapted weights, read as chat
reads them) and ``export-gguf`` (the GGUF LoRA adapter).

Both take the folder, or both refuse it with one UserError naming its file; a breakage that
changes what the adapter computes must be refused; another exception, a hang or an allocation
past 2 GiB is a bug.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import adapter_fuzz as af
import pytest
from hostile_corpus import TINY
from hypothesis import HealthCheck, given, settings
from safetensors import SafetensorError

from slideformer.engine.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The base, the adapter of a LoRA run on it, and the other folders a config may name."""
    root = tmp_path_factory.mktemp("adapter-fuzz")
    base = make_tiny_model(root / "model", "llama", TINY, seed=5)
    af.write_adapter_folder(root / "adapter", base)
    (root / "not-a-model").mkdir()
    return {"base": base, "adapter": root / "adapter", "missing": root / "missing",
            "not-a-model": root / "not-a-model",
            "other-width": make_tiny_model(root / "other-width", "llama",
                                           replace(TINY, hidden=64), seed=5),
            "fewer-layers": make_tiny_model(root / "fewer-layers", "llama",
                                            replace(TINY, layers=1), seed=5)}


def check_folder(folders: dict, broken) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "run" / "final"
        shutil.copytree(folders["adapter"], folder)
        for b in broken:
            try:
                b.change(folder, folders)
            except (FileNotFoundError, ValueError, TypeError, KeyError, AttributeError,
                    IndexError, RuntimeError, SafetensorError):
                continue  # an earlier breakage left nothing this one can edit
        return af.check_adapter(folder, folders, broken, Path(tmp))


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                       HealthCheck.filter_too_much])


@settings(max_examples=100, derandomize=True, **_SETTINGS)
@given(broken=af.breaks)
def test_hostile_adapter_folders(folders, broken):
    check_folder(folders, broken)


def test_the_intact_adapter_is_taken(folders):
    assert check_folder(folders, []) == "taken"


@pytest.mark.slow
def test_hostile_adapter_folders_long(folders, capsys):
    tally: Counter = Counter()

    @settings(max_examples=5000, **_SETTINGS)
    @given(broken=af.breaks)
    def run(broken):
        tally[check_folder(folders, broken)] += 1
        tally["lying"] += af.must_refuse(broken)

    t0 = time.perf_counter()
    run()
    n = tally["taken"] + tally["refused"]
    with capsys.disabled():
        print(f"\nadapter-folder fuzzing: {n} folders ({tally['lying']} broken in a way that "
              f"must be refused); chat and export-gguf: {tally['refused']} refused by both "
              f"naming the file, {tally['taken']} taken by both; 0 other exceptions, 0 hangs, "
              f"0 refusable breakages taken; {(time.perf_counter() - t0) / n * 1000:.0f} ms "
              "per folder")
