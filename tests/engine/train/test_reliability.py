"""Reliability on the CPU: crash-safe checkpoints, exact resume, damaged checkpoints, disk full,
out of GPU memory, non-finite steps, Ctrl-C and kill -9.

Every run trains the same tiny model on the same letter-reversal data (seq 32) in one folder,
so they share one token cache; an uninterrupted run of each optimizer setting is the reference
that interrupted, failed and resumed runs must match bitwise (CPU fp32).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.errors import UserError
from slideformer.engine.events import CheckpointSaved, Log, RunState, StepMetrics, read_events
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.checkpoint import checkpoint_bytes
from slideformer.engine.train.space import export_bytes
from slideformer.engine.train.state import state_tensors
from slideformer.engine.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
STEPS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """This module's folder: the runs go to ``runs/``."""
    root = tmp_path_factory.mktemp("reliability")
    (root / "runs").mkdir()
    return root


@pytest.fixture(scope="module")
def run_cfg(tiny_run, base):
    """``make(name, **over) -> RunConfig``: the tiny run (tests/conftest.py) in ``runs/name``,
    saving every step; ``over`` maps config keys (dots as double underscores) to values."""
    def make(name: str, **over) -> config_mod.RunConfig:
        return tiny_run(base / "runs" / name, {
            "train.max_steps": STEPS, "train.save_every": 1, "train.keep_checkpoints": 2,
            **{k.replace("__", "."): v for k, v in over.items()}})
    return make


@pytest.fixture(scope="module")
def reference(run_cfg):
    """``get(**over) -> run folder`` of an uninterrupted run (one per setting, built once)."""
    done: dict[tuple, Path] = {}

    def get(**over) -> Path:
        key = tuple(sorted(over.items()))
        if key not in done:
            cfg = run_cfg(f"ref-{len(done)}", **over)
            assert run_training(cfg) == "finished"
            done[key] = Path(cfg.output.run_dir)
        return done[key]

    return get


# ---- what the tests look at ---------------------------------------------------------------------
def step_losses(run_dir: Path) -> list:
    last = {}
    for ev in read_events(run_dir / "events.jsonl"):
        if isinstance(ev, StepMetrics) and not ev.skipped:
            last[ev.step] = ev.loss  # a resumed run repeats steps: the last report counts
    return [last[k] for k in sorted(last)]


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_same_run(run_dir: Path, ref: Path) -> None:
    """Same per-step losses and bitwise the same final weights as the reference run."""
    assert step_losses(run_dir) == step_losses(ref)
    a, b = final_weights(run_dir), final_weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def intact(folder: Path) -> bool:
    """Checked here without the engine: a manifest listing every file with its size and sha256."""
    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    on_disk = {p.name for p in folder.iterdir()} - {"manifest.json"}
    return set(files) == on_disk and all(
        (folder / n).stat().st_size == e["bytes"]
        and hashlib.sha256((folder / n).read_bytes()).hexdigest() == e["sha256"]
        for n, e in files.items())


def checkpoint_dirs(run_dir: Path) -> dict[int, Path]:
    """The folders named like a checkpoint (``step-N``)."""
    root = run_dir / "checkpoints"
    return {int(p.name[5:]): p for p in root.glob("step-*") if p.name[5:].isdigit()} \
        if root.is_dir() else {}


def events_of(run_dir: Path, kind, offset: int = 0) -> list:
    evs = read_events(run_dir / "events.jsonl")
    return [e for e in evs[offset:] if isinstance(e, kind)]


def last_state(run_dir: Path) -> RunState:
    return events_of(run_dir, RunState)[-1]


def copy_run(src: Path, base: Path, name: str) -> Path:
    dst = base / "runs" / name
    shutil.copytree(src, dst)
    return dst


# ---- checkpoint files and resume ----------------------------------------------------------------
def test_checkpoints_are_complete_rotated_and_readable(reference):
    run = reference()
    found = checkpoint_dirs(run)
    # keep_checkpoints = 2; the last one is written before the export (a failed export keeps it)
    assert sorted(found) == [STEPS - 1, STEPS]
    assert all(intact(p) for p in found.values())
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    from safetensors.torch import load_file
    newest = found[STEPS]
    assert set(load_file(str(newest / "layer0.safetensors"))) == {"w", "m", "v"}  # fp32: no rem
    meta = json.loads((newest / "trainer.json").read_text())
    assert meta["step"] == STEPS and meta["data"]["step"] == STEPS
    assert {"next_lr", "rng", "config", "total_steps"} <= set(meta)


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


DAMAGE = {
    "weight byte flipped": lambda d: _flip_byte(d / "layer1.safetensors", -5),
    "header byte flipped": lambda d: _flip_byte(d / "head.safetensors", 20),
    "file truncated": lambda d: os.truncate(d / "embed.safetensors", 1000),
    "file missing": lambda d: (d / "layer2.safetensors").unlink(),
    "manifest missing": lambda d: (d / "manifest.json").unlink(),
    "trainer state altered": lambda d: (d / "trainer.json").write_text(
        (d / "trainer.json").read_text().replace(f'"step": {STEPS}', f'"step": {STEPS - 1}')),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(base, run_cfg, reference, damage):
    run = copy_run(reference(), base, f"damaged-{damage.replace(' ', '-')}")
    newest = checkpoint_dirs(run)[STEPS]
    DAMAGE[damage](newest)
    n = len(read_events(run / "events.jsonl"))
    assert run_training(run_cfg(run.name), resume=True) == "finished"
    logs = [e.message for e in events_of(run, Log, n)]
    assert any(m.startswith(f"checkpoint step-{STEPS} is damaged") for m in logs), logs
    assert f"resumed from step-{STEPS - 1}" in logs
    assert (run / "checkpoints" / f"step-{STEPS}.corrupt").is_dir()
    assert_same_run(run, reference())


def test_resume_restores_schedule_data_and_rng(base, run_cfg, reference):
    import base64
    run = copy_run(reference(), base, "restore")
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")  # as if killed before the final save
    t = Trainer(run_cfg(run.name))
    torch.manual_seed(123)
    random.seed(123)
    t.setup(resume=True)
    meta = json.loads((run / "checkpoints" / f"step-{STEPS - 1}" / "trainer.json").read_text())
    assert t.step == STEPS - 1 and t.stream.state_dict() == meta["data"]
    assert t.hyper(1.0).lr == meta["next_lr"]
    assert bytes(torch.get_rng_state().tolist()) == base64.b64decode(meta["rng"]["torch"])
    assert list(random.getstate()[1]) == meta["rng"]["python"][1]
    t.cleanup()


def test_run_that_saved_nothing_can_start_again_in_its_folder(run_cfg, reference, monkeypatch):
    cfg = run_cfg("again")
    _enospc_in(monkeypatch, ".step-1.tmp")  # its first checkpoint fails: nothing to resume
    assert run_training(cfg) == "failed"
    message = last_state(Path(cfg.output.run_dir)).message
    assert "there is no complete checkpoint yet" in message
    assert "--resume" not in message.replace("without --resume", "")  # the advice is true
    monkeypatch.undo()
    assert run_training(cfg) == "finished"
    assert_same_run(Path(cfg.output.run_dir), reference())


def test_event_log_torn_by_a_kill_stays_readable(tmp_path):
    from slideformer.engine.events import EventSink, to_json
    path = tmp_path / "events.jsonl"
    path.write_text(to_json(Log("info", "before")) + "\n" + to_json(Log("info", "torn"))[:20])
    sink = EventSink(path)
    sink.emit(Log("info", "after"))
    sink.close()
    assert [e.message for e in read_events(path)] == ["before", "after"]


# ---- disk full ----------------------------------------------------------------------------------
def _enospc_in(monkeypatch, name_part: str) -> None:
    """Make the checkpoint writer fail with ENOSPC on files whose path contains ``name_part``."""
    from slideformer.engine.train import checkpoint
    real = checkpoint._HashingFile.write

    def write(self, data):
        if name_part in self.f.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, data)

    monkeypatch.setattr(checkpoint._HashingFile, "write", write)


def test_disk_full_during_a_checkpoint_keeps_the_previous_and_fails_cleanly(run_cfg, reference,
                                                                            monkeypatch):
    cfg = run_cfg("disk-full")
    run = Path(cfg.output.run_dir)
    _enospc_in(monkeypatch, f".step-3.tmp{os.sep}layer1")
    assert run_training(cfg) == "failed"
    end = last_state(run)
    assert "No space left on device" in end.message and "step-2" in end.message
    assert "fix:" in end.message and "--resume" in end.message
    assert sorted(checkpoint_dirs(run)) == [1, 2]
    assert all(map(intact, checkpoint_dirs(run).values()))
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] == []
    assert not (run / "final").exists()
    monkeypatch.undo()
    assert run_training(cfg, resume=True) == "finished"
    assert_same_run(run, reference())


def _free_space(monkeypatch, free: int) -> None:
    """The run folder's disk reports ``free`` bytes."""
    real = shutil.disk_usage
    monkeypatch.setattr("slideformer.engine.train.space.shutil.disk_usage",
                        lambda p: real(p)._replace(free=free))


def test_a_disk_too_small_for_a_checkpoint_is_refused_before_training(run_cfg, monkeypatch):
    """The trained steps would have nowhere to go: refused at set-up, with the sizes."""
    cfg = run_cfg("too-small")
    _free_space(monkeypatch, 1000)
    with pytest.raises(UserError) as e:
        run_training(cfg)
    assert "free, but the run needs" in e.value.problem and "a checkpoint of" in e.value.problem
    assert "output.run_dir" in e.value.fix
    events = Path(cfg.output.run_dir) / "events.jsonl"
    assert not events.exists() or not [x for x in read_events(events) if isinstance(x, StepMetrics)]


def test_room_for_fewer_checkpoints_than_kept_is_a_warning(run_cfg, monkeypatch):
    probe = Trainer(run_cfg("probe"))
    probe.setup()
    one = (checkpoint_bytes(state_tensors(probe.host))
           + export_bytes(probe.spec, probe.host, None))
    probe.cleanup()
    cfg = run_cfg("tight-disk")
    _free_space(monkeypatch, one + 1000)
    assert run_training(cfg) == "finished"
    warnings = [e.message for e in read_events(Path(cfg.output.run_dir) / "events.jsonl")
                if isinstance(e, Log) and e.level == "warning" and "keep_checkpoints" in e.message]
    assert len(warnings) == 1


def test_disk_full_on_a_real_small_filesystem(base, run_cfg, reference, tmp_path):
    """A tmpfs that holds two checkpoints but not a third (skipped where it cannot be mounted)."""
    ckpt = sum(p.stat().st_size for p in checkpoint_dirs(reference())[STEPS - 1].iterdir())
    mnt = tmp_path / "small"
    mnt.mkdir()
    size = int(2.5 * ckpt) + (256 << 10)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:  # the token cache stays on the real disk (the run maps its files)
        (mnt / ".token-cache").symlink_to(base / "runs" / ".token-cache")
        cfg = config_mod.override(run_cfg("x"), {"output.run_dir": str(mnt / "run")})
        t = Trainer(cfg)
        t.setup()
        assert t.train() == "failed"
        t.cleanup()
        run = mnt / "run"
        end = last_state(run)
        assert "No space left on device" in end.message
        assert "newest complete checkpoint" in end.message
        assert checkpoint_dirs(run) and all(map(intact, checkpoint_dirs(run).values()))
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_failed_export_keeps_the_previous_final_model(base, run_cfg, reference, monkeypatch):
    run = copy_run(reference(), base, "export-fails")
    before = {p.name: p.read_bytes() for p in (run / "final").iterdir()}

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("safetensors.torch.save_file", no_space)
    extended = run_cfg(run.name, train__max_steps=STEPS + 1)
    assert run_training(extended, resume=True) == "failed"
    assert "could not write the final model" in last_state(run).message
    assert {p.name: p.read_bytes() for p in (run / "final").iterdir()} == before
    assert not (run / "final.partial").exists()


# ---- non-finite steps ---------------------------------------------------------------------------
class Masters:
    """Snapshots of the host masters at every step report (CPU: updates are done by then)."""

    def __init__(self):
        self.trainer, self.at = None, {}

    def __call__(self, ev):
        if isinstance(ev, StepMetrics):
            self.at[len(self.at) + 1] = {n: it.master() for n, it in self.trainer.host.items()}

    def run(self, cfg) -> str:
        self.trainer = t = Trainer(cfg, callbacks=[self])
        t.setup()
        try:
            return t.train()
        finally:
            t.cleanup()

    def changed(self, call: int) -> set[str]:
        """Items whose master changed in the ``call``-th step."""
        a, b = self.at[call - 1], self.at[call]
        return {n for n in a if not torch.equal(a[n], b[n])}


def _poison_loss(monkeypatch, calls: set[int]) -> None:
    """A NaN loss and NaN gradients from the head in the given (1-based) steps."""
    import slideformer.engine.runtime.ends as ex  # where the head step calls it
    real, n = ex.linear_ce_fwd_bwd, [0]

    def fwd_bwd(*a, **k):
        loss, gh = real(*a, **k)
        n[0] += 1
        return (loss * float("nan"), gh * float("nan")) if n[0] in calls else (loss, gh)

    monkeypatch.setattr(ex, "linear_ce_fwd_bwd", fwd_bwd)


def _in_layer_backward(monkeypatch, step: int, layer: int, what) -> None:
    """Call ``what(g)`` after the backward of ``layer`` in the ``step``-th step (3 layers)."""
    from slideformer.engine.runtime.executor import SlidingExecutor
    real, n = SlidingExecutor._layer_backward, [0]

    def layer_backward(self, w, g, *a):
        out = real(self, w, g, *a)
        c, n[0] = n[0], n[0] + 1
        if c // 3 == step - 1 and 2 - c % 3 == layer:
            what(g)
        return out

    monkeypatch.setattr(SlidingExecutor, "_layer_backward", layer_backward)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_nonfinite_loss_skips_the_whole_step(run_cfg, monkeypatch, clip):
    _poison_loss(monkeypatch, {3})
    m = Masters()
    assert m.run(run_cfg(f"nan-loss-{clip}", optim__max_grad_norm=clip)) == "finished"
    assert m.changed(3) == set() and m.changed(4)
    run = Path(m.trainer.cfg.output.run_dir)
    skipped = [e for e in events_of(run, StepMetrics) if e.skipped]
    assert len(skipped) == 1 and skipped[0].loss is None
    assert any("step skipped, weights unchanged" in e.message for e in events_of(run, Log))


def test_gradient_overflow_without_clipping_is_reported_honestly(run_cfg, monkeypatch):
    _in_layer_backward(monkeypatch, step=3, layer=1, what=lambda g: g.fill_(float("inf")))
    m = Masters()
    assert m.run(run_cfg("inf-grad", optim__max_grad_norm=0.0)) == "finished"
    assert m.changed(3) == {"layer2"}  # updated during the backward before layer 1's overflow
    logs = [e.message for e in events_of(Path(m.trainer.cfg.output.run_dir), Log)]
    assert any("1 layer updates had already been applied" in x for x in logs), logs


def test_three_nonfinite_steps_in_a_row_stop_and_save(run_cfg, reference, monkeypatch):
    cfg = run_cfg("nan-3")
    run = Path(cfg.output.run_dir)
    _poison_loss(monkeypatch, {3, 4, 5})
    assert run_training(cfg) == "failed"
    end = last_state(run)
    assert "3 steps in a row" in end.message and "fix:" in end.message and end.step == 2
    assert max(checkpoint_dirs(run)) == 2 and not (run / "final").exists()
    monkeypatch.undo()
    assert run_training(cfg, resume=True) == "finished"
    assert_same_run(run, reference())


# ---- out of GPU memory --------------------------------------------------------------------------
def _oom(g):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_rolls_the_step_back_and_saves(run_cfg, reference, monkeypatch):
    """With clipping the updates made in the backward are speculative and undone: the step
    rolls back exactly."""
    cfg = run_cfg("oom", train__save_every=0)
    run = Path(cfg.output.run_dir)
    _in_layer_backward(monkeypatch, step=3, layer=1, what=_oom)
    assert run_training(cfg) == "failed"
    end = last_state(run)
    assert "out of GPU memory in step 3; the step was rolled back" in end.message
    assert "budget.checkpoints" in end.message and end.step == 2
    assert sorted(checkpoint_dirs(run)) == [2]  # the state before the failed step
    monkeypatch.undo()
    assert run_training(cfg, resume=True) == "finished"
    assert_same_run(run, reference())


def test_out_of_memory_without_clipping_keeps_the_newest_checkpoint(run_cfg, reference,
                                                                     monkeypatch):
    cfg = run_cfg("oom-noclip", optim__max_grad_norm=0.0)
    run = Path(cfg.output.run_dir)
    _in_layer_backward(monkeypatch, step=3, layer=1, what=_oom)
    assert run_training(cfg) == "failed"
    assert "1 of its updates were applied" in last_state(run).message
    assert max(checkpoint_dirs(run)) == 2
    monkeypatch.undo()
    assert run_training(cfg, resume=True) == "finished"
    assert_same_run(run, reference(optim__max_grad_norm=0.0))


def test_run_that_cannot_fit_host_ram_is_refused_before_anything_loads(run_cfg, monkeypatch):
    from slideformer.engine.errors import UserError

    def loaded(*a, **k):
        raise AssertionError("loaded something")

    for target in ("slideformer.engine.train.trainer.load_weights", "slideformer.engine.train.trainer.load_tokenizer",
                   "slideformer.engine.train.trainer.build_host_state"):
        monkeypatch.setattr(target, loaded)
    t = Trainer(run_cfg("too-big", budget__ram="1MiB"))
    with pytest.raises(UserError) as e:
        t.setup()
    assert e.value.where == "budget.ram" and "host RAM" in e.value.problem
    t.cleanup()


# ---- signals and kill -9 (the real command in a child process) ----------------------------------
def _start(cfg_path: Path, *args, slow_io: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, SLIDEFORMER_TEST_SLOW_IO=str(slow_io) if slow_io else "")
    return subprocess.Popen([sys.executable, "-m", "slideformer.engine.cli", "train", "--config", str(cfg_path),
                             *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _write_cfg(base: Path, cfg: config_mod.RunConfig) -> tuple[Path, Path]:
    """Write ``cfg`` to a TOML file beside the runs; returns (that file, the run folder)."""
    path = base / f"{Path(cfg.output.run_dir).name}.toml"
    path.write_text(config_mod.dumps(cfg))
    return path, Path(cfg.output.run_dir)


def _wait_for(p: subprocess.Popen, pred, every: float = 0.002, exit_ok: bool = False) -> None:
    """Poll until ``pred`` or until the training process ``p`` ends (its max_steps bound it:
    no clock); ``exit_ok``: its end is an answer too, else a failure naming its stderr."""
    while not pred():
        if p.poll() is not None:
            assert exit_ok or pred(), f"the run ended first (exit {p.returncode}): {p.stderr.read()}"
            return
        time.sleep(every)


def _events_count(run: Path, kind) -> int:
    """Events of a kind so far (a cheap look at the raw file, fit for polling)."""
    try:
        return (run / "events.jsonl").read_bytes().count(f'"kind": "{kind.__name__}"'.encode())
    except FileNotFoundError:
        return 0


def test_ctrl_c_finishes_the_step_saves_and_exits_0(base, run_cfg):
    path, run = _write_cfg(base, run_cfg("sigint", train__max_steps=10_000, train__save_every=0))
    p = _start(path)
    _wait_for(p, lambda: _events_count(run, StepMetrics) >= 2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "stopping after this step and saving" in err and "Traceback" not in err
    assert "[stopped] model saved to" in out and "--resume" in out
    end = last_state(run)
    assert end.state == "stopped" and intact(checkpoint_dirs(run)[end.step])
    assert (run / "final" / "model.safetensors").is_file()


def test_second_ctrl_c_aborts_and_leaves_no_incomplete_checkpoint(base, run_cfg):
    path, run = _write_cfg(base, run_cfg("sigint2", train__max_steps=10_000))
    p = _start(path, slow_io=0.2)
    _wait_for(p, lambda: _events_count(run, CheckpointSaved) >= 1)
    p.send_signal(signal.SIGINT)  # stop after this step, saving: the save takes ~2 s here
    _wait_for(p, lambda: any((run / "checkpoints").glob(".step-*.tmp/*.safetensors")))
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err
    found = checkpoint_dirs(run)
    assert found and all(map(intact, found.values()))
    assert not list((run / "checkpoints").glob(".step-*.tmp"))
    p = _start(path, "--resume", "--max-steps", str(max(found) + 1))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert f"resumed from step-{max(found)}" in out


def _kill_cycles(base: Path, run_cfg, reference, kills: int, seed: int) -> None:
    """Kill the training process with SIGKILL ``kills`` times at random moments, resume each
    time, and check: every folder named like a checkpoint is complete, each resume starts from
    the newest of them, and the run ends exactly as an uninterrupted one."""
    steps = 12 + 3 * kills
    path, run = _write_cfg(base, run_cfg(f"kill-{seed}", train__max_steps=steps))
    rng = random.Random(seed)
    resumes, hows, during_write = 0, [], 0
    for k in range(kills):
        newest = max(checkpoint_dirs(run), default=None)
        offset = len(read_events(run / "events.jsonl")) if run.exists() else 0
        steps_before = _events_count(run, StepMetrics)
        p = _start(path, *(["--resume"] if newest is not None else []), slow_io=0.005)
        how = rng.choice(["during a checkpoint", "after a step", "any time"])
        if newest is None:  # a run killed before its first checkpoint cannot be resumed
            _wait_for(p, lambda: _events_count(run, CheckpointSaved), exit_ok=True)
        if how == "any time":
            time.sleep(rng.uniform(0.0, 2.5))
        else:
            _wait_for(p, lambda: _events_count(run, StepMetrics) > steps_before
                      and (how == "after a step" or any((run / "checkpoints").glob(".step-*.tmp"))),
                      every=0.003, exit_ok=True)
            time.sleep(rng.uniform(0.0, 0.05 if how == "during a checkpoint" else 0.3))
        writing = any((run / "checkpoints").glob(".step-*.tmp"))
        p.kill()
        _, err = p.communicate()
        assert p.returncode == -signal.SIGKILL, f"kill {k} ({how}): the run ended by itself: {err}"
        hows.append(how)
        during_write += writing
        found = checkpoint_dirs(run)
        bad = [n for n, d in found.items() if not intact(d)]
        assert not bad, f"kill {k} ({how}): incomplete checkpoints carry a name: {bad}"
        logs = [e.message for e in events_of(run, Log, offset)] if run.exists() else []
        resumed = [m for m in logs if m.startswith("resumed from ")]
        if resumed:
            assert resumed == [f"resumed from step-{newest}"], (k, how, resumed)
            resumes += 1
    p = _start(path, "--resume")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert resumes >= kills // 3
    print(f"{kills} kills ({', '.join(f'{hows.count(h)} {h}' for h in sorted(set(hows)))}; "
          f"{during_write} with a checkpoint being written), {resumes} resumes checked")
    assert_same_run(run, reference(train__max_steps=steps, train__save_every=0))


def test_kill_9_at_random_moments_quick(base, run_cfg, reference):
    _kill_cycles(base, run_cfg, reference, kills=3, seed=1)


@pytest.mark.slow
def test_kill_9_at_random_moments(base, run_cfg, reference):
    _kill_cycles(base, run_cfg, reference, kills=24, seed=2)
