"""kill -9 inside each kind of save, at precise points: a checkpoint, a checkpoint rotation, the
final export of full fine-tuning, the token cache of a dataset's first run, the LoRA adapter
export and the merged export.

The run is the real command in a child process. ``SLIDEFORMER_TEST_PAUSE_AT`` (the test hook of
slideformer.engine.testhooks) makes it stop at one named point of a writer, the n-th time it gets
there; the test SIGKILLs it during that pause. Then: what the kill left is never taken as
complete (no ``step-N`` that does not verify, no ``final/`` that is not whole, no token-cache
entry without its meta.json), the same command continues (``--resume``, or run again when no
checkpoint was written yet), the run ends bitwise as an uninterrupted one (CPU fp32, the tiny
model, as tests/engine/train/test_reliability.py) without training a step twice when only the
export was cut, and nothing temporary is left behind. Each case prints one line of the table
in docs/design/reliability.md.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slideformer.engine import config as config_mod
from slideformer.engine.events import Log, RunState, StepMetrics, read_events
from slideformer.engine.train.commands import run_training
from tests.engine.train.test_reliability import checkpoint_dirs, intact, step_losses

REPO = Path(__file__).resolve().parents[3]
STEPS, LONG, EXTENDED = 6, 12, 8
FILES, TENSORS = 7, 15
"""Files of a checkpoint of the tiny model (5 items, trainer.json, manifest.json) and tensors of
its item files (w, m, v each): the counts the checkpoint points below are computed from."""
EXPORTS = ("final", "final-merged")
RUN_FILES = {"events.jsonl", "config.toml", "checkpoints", "lock", *EXPORTS}
"""What a finished run folder may hold."""
_TEMPORARY = re.compile(r"(\.tmp|\.old|\.partial)$|\.tmp-|^\.step-")


@dataclass(frozen=True)
class Case:
    kind: str
    point: str
    """Where the run is killed: ``<point>@<n>`` of slideformer.engine.testhooks."""
    left: tuple[str, ...]
    """Globs (under the case folder) that the kill must have left: it came inside the write."""
    steps: int = STEPS
    over: dict = field(default_factory=dict)
    """Config keys (dots as double underscores) of the run."""
    extend: bool = False
    """The run is a finished one resumed with more steps: an earlier final/ is replaced."""
    named: tuple[int, ...] | None = None
    """The checkpoints named ``step-N`` right after the kill (None: not checked)."""
    fresh_cache: bool = False
    """The run is the first of its dataset: its token cache is written by the killed run."""


SHARDS = {"output__shard_size": "16KiB"}  # the final export writes several shards
LORA = {"train__method": "lora"}
MERGED = {"train__method": "lora", "lora__export_merged": True}
CASES = [
    Case("checkpoint", f"checkpoint.file@{2 * FILES + 3}", ("run/checkpoints/.step-3.tmp",),
         named=(1, 2)),
    Case("checkpoint", f"checkpoint.tensor@{2 * TENSORS + 2}",
         ("run/checkpoints/.step-3.tmp/embed.safetensors",), named=(1, 2)),
    Case("checkpoint", "checkpoint.commit@3", ("run/checkpoints/.step-3.tmp/manifest.json",),
         named=(1, 2)),
    Case("rotation", "checkpoint.rotate@3", (), steps=LONG, named=(3, 4, 5)),
    Case("rotation", "checkpoint.delete@3", ("run/checkpoints/.step-3.old",), steps=LONG,
         named=(4, 5)),
    Case("rotation", "checkpoint.rotate@10", (), steps=LONG, named=(10, 11, 12)),
    Case("rotation", "checkpoint.delete@10", ("run/checkpoints/.step-10.old",), steps=LONG,
         named=(11, 12)),
    Case("final", "export.item@2", ("run/final.partial/part-0.safetensors",), over=SHARDS),
    Case("final", "publish.start@1", ("run/final.partial/config.json",), over=SHARDS),
    Case("final", "publish.swap@1", ("run/final.old", "run/final.partial"), extend=True),
    Case("token cache", "store.append@1", (".token-cache/tokens-*.tmp-*/tokens.bin",),
         fresh_cache=True),
    Case("token cache", "cache.entry@1", (".token-cache/tokens-*.tmp-*/offsets.npy",),
         fresh_cache=True),
    Case("token cache", "cache.entry@2", (".token-cache/tokens-*/meta.json",
                                          ".token-cache/rows-*.tmp-*/train.npz"),
         fresh_cache=True),
    Case("adapter", "adapter.file@1", ("run/final.partial/adapter_model.safetensors",),
         over=LORA),
    Case("adapter", "publish.swap@1", ("run/final.old", "run/final.partial"), over=LORA,
         extend=True),
    Case("merged", "merged.item@2", ("run/final-merged.partial/part-0.safetensors",),
         over={**MERGED, **SHARDS}),
    Case("merged", "publish.swap@2", ("run/final-merged", "run/final.old", "run/final.partial"),
         over=MERGED, extend=True),
]
QUICK = {("checkpoint", "checkpoint.tensor@32"), ("rotation", "checkpoint.delete@10"),
         ("final", "export.item@2"), ("token cache", "cache.entry@1"),
         ("adapter", "publish.swap@1"), ("merged", "merged.item@2")}
"""One case of each kind in the default suite (about 5 s each); ``-m slow`` runs them all."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every run on one thread, the references here as the children (OMP_NUM_THREADS=1): see
    tests/conftest.py's one_torch_thread, whose scope is one test."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill-matrix")
    (root / "runs").mkdir()
    return root


@pytest.fixture(scope="module")
def run_cfg(tiny_run):
    """``make(run_dir, steps, **over) -> RunConfig``: the tiny run saving every step."""
    def make(run_dir: Path, steps: int = STEPS, **over) -> config_mod.RunConfig:
        return tiny_run(run_dir, {"train.max_steps": steps, "train.save_every": 1,
                                  "train.keep_checkpoints": 2,
                                  **{k.replace("__", "."): v for k, v in over.items()}})
    return make


@pytest.fixture(scope="module")
def reference(base, run_cfg):
    """``get(steps, extend, **over) -> run folder`` of an uninterrupted run (built once each);
    ``extend``: the run of STEPS steps, finished, then resumed to EXTENDED steps."""
    done: dict[tuple, Path] = {}

    def get(steps: int = STEPS, extend: bool = False, **over) -> Path:
        key = (steps, extend, tuple(sorted(over.items())))
        if key not in done:
            start = get(STEPS, **over) if extend else None
            run = base / "runs" / f"ref-{len(done)}"
            if extend:
                shutil.copytree(start, run)
                assert run_training(run_cfg(run, EXTENDED, **over), resume=True) == "finished"
            else:
                assert run_training(run_cfg(run, steps, **over)) == "finished"
            done[key] = run
        return done[key]

    return get


# ---- what the tests look at ---------------------------------------------------------------------
def exported(run: Path) -> dict:
    """Every tensor of the run's exports (``final/`` and ``final-merged/``), by folder and name."""
    from safetensors.torch import load_file
    return {f"{d}/{k}": v for d in EXPORTS if (run / d).is_dir()
            for f in sorted((run / d).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def leftovers(folder: Path) -> list[str]:
    """Temporary, partial and half-deleted files and folders anywhere under ``folder``."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if _TEMPORARY.search(p.name))


def last_state(run: Path) -> RunState:
    return [e for e in read_events(run / "events.jsonl") if isinstance(e, RunState)][-1]


def _steps_reported(run: Path) -> int:
    return sum(isinstance(e, StepMetrics) for e in read_events(run / "events.jsonl"))


# ---- the killed child ---------------------------------------------------------------------------
def _kill_at(cfg: config_mod.RunConfig, pause: str, *args: str) -> None:
    """Run ``slideformer train`` on ``cfg``, and SIGKILL it while it is paused at ``pause``."""
    run = Path(cfg.output.run_dir)
    path = run.with_name(run.name + ".toml")
    path.write_text(config_mod.dumps(cfg))
    out, err = path.with_suffix(".out"), path.with_suffix(".err")
    env = dict(os.environ, SLIDEFORMER_TEST_PAUSE_AT=pause, OMP_NUM_THREADS="1")
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen([sys.executable, "-m", "slideformer.engine.cli", "train", "--config",
                              str(path), *args], cwd=REPO, env=env, stdout=o, stderr=e)
    try:
        deadline = time.monotonic() + 300
        while f"test hook: paused at {pause}" not in err.read_text(errors="replace"):
            assert p.poll() is None, f"the run ended (exit {p.returncode}) before {pause}: " \
                                     f"{err.read_text()}"
            assert time.monotonic() < deadline, f"no pause at {pause} in 300 s"
            time.sleep(0.01)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == -signal.SIGKILL


@pytest.mark.parametrize("case", [
    pytest.param(c, id=f"{c.kind}-{c.point}",
                 marks=() if (c.kind, c.point) in QUICK else pytest.mark.slow) for c in CASES])
def test_kill_inside_a_save_loses_nothing(case, base, run_cfg, reference):
    folder = base / f"{case.kind}-{case.point}".replace(" ", "-")
    if not case.fresh_cache:  # a run in runs/ shares the token cache the references wrote
        folder = base / "runs" / folder.name
    run = folder / "run"
    folder.mkdir()
    ref = reference(case.steps, case.extend, **case.over)
    steps = EXTENDED if case.extend else case.steps
    cfg = run_cfg(run, steps, **case.over)
    if case.extend:
        shutil.copytree(reference(STEPS, **case.over), run)
        _kill_at(run_cfg(run, STEPS, **case.over), case.point, "--resume",
                 "--max-steps", str(EXTENDED))
    else:
        _kill_at(cfg, case.point)

    # what the kill left: proof that it came inside the write, never taken as complete
    for pattern in case.left:
        assert list(folder.glob(pattern)), f"{pattern} is missing after the kill: " \
                                           f"{sorted(str(p) for p in folder.rglob('*'))}"
    named = checkpoint_dirs(run)
    assert all(intact(d) for d in named.values())
    if case.named is not None:
        assert tuple(sorted(named)) == case.named
    for name in EXPORTS:  # an export cut short has no name of its own
        assert not (run / name).exists() or case.extend and name == "final-merged"
    assert not (run / "events.jsonl").exists() or last_state(run).state != "finished"
    for entry in folder.glob(".token-cache/*-*"):
        assert _TEMPORARY.search(entry.name) or (entry / "meta.json").is_file()

    # the same command continues, and ends as the uninterrupted run
    resumable = bool(named)
    before = _steps_reported(run) if (run / "events.jsonl").exists() else 0
    n = len(read_events(run / "events.jsonl")) if (run / "events.jsonl").exists() else 0
    assert run_training(cfg, resume=resumable) == "finished"
    logs = [e.message for e in read_events(run / "events.jsonl")[n:] if isinstance(e, Log)]
    if resumable:
        assert f"resumed from step-{max(named)}" in logs
    if case.kind in ("final", "adapter", "merged"):  # only the export was cut: no step again
        assert _steps_reported(run) == before
    if case.point in ("store.append@1", "cache.entry@1"):  # the torn entry is rebuilt
        assert any(" tokenized " in m for m in logs), logs
    assert step_losses(run) == step_losses(ref)
    got, want = exported(run), exported(ref)
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)

    # nothing temporary is left, and exactly the kept checkpoints
    left = leftovers(folder)
    assert left == [], left
    assert sorted(checkpoint_dirs(run)) == [steps - 1, steps]
    assert {p.name for p in run.iterdir()} <= RUN_FILES
    print(f"\nkill matrix | {case.kind} | {case.point} | resumed bit-identical: yes | "
          f"leftovers: {len(left)}")


def test_the_checkpoint_points_count_what_a_checkpoint_holds(reference):
    """FILES and TENSORS, which the checkpoint points of CASES are computed from."""
    from safetensors import safe_open
    step = checkpoint_dirs(reference())[STEPS]
    files = list(step.iterdir())
    assert len(files) == FILES
    tensors = 0
    for f in step.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            tensors += len(list(st.keys()))
    assert tensors == TENSORS


def test_many_checkpoints_leave_exactly_the_kept_ones(reference):
    """12 steps saving every step, keeping 2: step-11 and step-12, nothing else."""
    run = reference(LONG)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-11", "step-12"]
    assert leftovers(run) == []
