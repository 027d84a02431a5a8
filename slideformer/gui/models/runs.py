"""Reading run folders, without Qt: follow ``events.jsonl``, summarise a run, tail its log.

A run folder is whatever ``slideformer train`` wrote (DESIGN.md section 6): ``config.toml``,
``events.jsonl``, ``checkpoints/step-N/``, ``final/``, and ``control`` (:mod:`slideformer.engine.train.control`:
it names the process running the run). A run the app started also has ``engine.log``, the
engine's console output. A run started in a terminal and one started by the app look the same.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.api import (CONFIG_FILE, EVENTS_FILE, LOG_FILE, TERMINAL_STATES, RunClient,
                                    RunState, StepMetrics, UserError, checkpoints, from_json,
                                    load_config)
SUMMARY_TAIL_BYTES = 256 << 10
"""A summary reads at most this much of the end of ``events.jsonl`` (a long run's file holds
tens of MB): enough for the last state change and step of any run."""


@dataclass(frozen=True)
class RunSummary:
    """What the Runs page lists about one run folder."""

    path: Path
    status: str
    """setup, running, paused, saving, finished, stopped, failed, or interrupted (the engine
    process ended without a final state: killed or crashed)."""
    step: int
    total_steps: int
    loss: float | None
    """Loss of the last step (None before the first step)."""
    model: str
    """The model folder of the run's config ("" when the config cannot be read)."""
    data: str
    updated: float
    """Time of the last event (seconds since the epoch)."""
    checkpoint: int | None
    """Step of the newest complete checkpoint, the point a resume continues from."""
    has_final: bool
    """``final/`` holds an exported model."""
    live: bool
    """A process is running this run now."""
    settings: str = ""
    """What tells this run from its neighbours: tokens per step, its shape and learning rate."""
    best: tuple[int, float] | None = None
    """(step, validation loss) of the best checkpoint output.keep_best kept (None: none)."""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def resumable(self) -> bool:
        return not self.live and self.checkpoint is not None and self.status != "finished"


def is_run_dir(path: Path) -> bool:
    return (path / EVENTS_FILE).is_file()


def latest_checkpoint(run_dir: Path) -> int | None:
    """The step of the newest committed checkpoint in ``run_dir`` (where ``--resume`` starts,
    unless the engine finds it damaged and falls back to an older one)."""
    found = checkpoints(Path(run_dir) / "checkpoints")
    return int(found[0].name.removeprefix("step-")) if found else None


def summarize(run_dir: Path | str) -> RunSummary:
    """The state of a run from its files (reads only the end of ``events.jsonl``)."""
    run_dir = Path(run_dir)
    state, step, total, loss, updated = "setup", 0, 0, None, 0.0
    for ev in _tail_events(run_dir / EVENTS_FILE):
        updated = ev.time
        if isinstance(ev, RunState):
            state, step = ev.state, ev.step
        elif isinstance(ev, StepMetrics):
            state = "running" if state in ("setup", "paused") else state
            step, total, loss = ev.step, ev.total_steps, ev.loss
    live = RunClient(run_dir).alive() is not None
    if state not in TERMINAL_STATES and not live:
        state = "interrupted"
    model = data = settings = ""
    try:
        cfg = load_config(run_dir / CONFIG_FILE)
        model, data = cfg.model.path, cfg.data.train
        total = total or cfg.train.max_steps
        t = cfg.train
        settings = (f"{t.micro_batch} x {t.grad_accum} x {cfg.data.max_seq_len} tokens, "
                    f"lr {cfg.optim.lr:g}")
    except UserError:
        pass
    return RunSummary(path=run_dir, status=state, step=step, total_steps=total, loss=loss,
                      model=model, data=data, updated=updated,
                      checkpoint=latest_checkpoint(run_dir),
                      has_final=(run_dir / "final" / "config.json").is_file(), live=live,
                      settings=settings, best=kept_best(run_dir))


def kept_best(run_dir: Path) -> tuple[int, float] | None:
    """The best checkpoint the newest checkpoint's trainer state names, when it is on disk."""
    found = checkpoints(run_dir / "checkpoints")
    try:
        best = json.loads((found[0] / "trainer.json").read_text(encoding="utf-8"))["best"]
        step, loss = int(best[0]), float(best[1])
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return None
    return (step, loss) if (run_dir / "checkpoints" / f"step-{step}").is_dir() else None


def _tail_events(path: Path) -> list:
    """The complete events in the last :data:`SUMMARY_TAIL_BYTES` of an events file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - SUMMARY_TAIL_BYTES))
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if size > SUMMARY_TAIL_BYTES:
        lines = lines[1:]  # the first line was cut by the seek
    out = []
    for line in lines[:-1]:  # the last piece is empty or a line still being written
        try:
            out.append(from_json(line.decode("utf-8")))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def scan_runs(roots: list[Path], extra: list[Path] = ()) -> list[RunSummary]:
    """Summaries of the run folders directly inside ``roots`` and of ``extra``, newest first."""
    dirs = {p.resolve() for p in extra if is_run_dir(p)}
    for root in roots:
        if root.is_dir():
            dirs.update(p.resolve() for p in root.iterdir() if p.is_dir() and is_run_dir(p))
    return sorted((summarize(d) for d in dirs), key=lambda s: s.updated, reverse=True)


def text_tail(path: Path | str, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.replace("\r", "\n").rstrip().splitlines()[-lines:])


def engine_log(run_dir: Path | str) -> Path:
    return Path(run_dir) / LOG_FILE


def read_config_text(run_dir: Path | str) -> str:
    try:
        return (Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8")
    except OSError:
        return ""

