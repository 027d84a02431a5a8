"""Engine events: frozen, JSON-serialisable dataclasses, the only thing front ends consume.

Every event has a ``kind`` (its class name in snake case) and a wall-clock ``time``. A missing
metric is ``None``. :func:`to_json` / :func:`from_json` round-trip them through ``events.jsonl``.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class RunState:
    """The run changed state: setup, running, paused, saving, finished, stopped, failed."""
    state: str
    message: str = ""
    step: int = 0
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step finished."""
    step: int
    total_steps: int
    loss: float | None
    lr: float
    grad_norm: float | None
    tokens: int
    """Trained (unmasked) tokens in this step."""
    tokens_per_s: float | None
    """All tokens processed (incl. masked prompt tokens) per second of step wall time."""
    step_time: float
    peak_vram: int | None
    """Peak GPU memory reserved in bytes since the previous step; None on CPU."""
    peak_ram: int | None
    """Peak host RSS in bytes."""
    skipped: bool = False
    """True when the update was skipped (non-finite loss or gradients)."""
    data_time: float | None = None
    """Seconds of ``step_time`` spent assembling the step's micro-batches (reading, packing,
    sampling GRPO's rollouts) before the executor started: a data-bound run shows it here.
    None where it was not measured (events written before it existed)."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class EvalMetrics:
    step: int
    val_loss: float
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class PairMetrics:
    """A preference objective's step (train.objective dpo, orpo, simpo): its pairs' implicit
    rewards (slideformer.engine.train.objectives)."""
    step: int
    accuracy: float
    """Share of pairs whose chosen reward is above the rejected one."""
    chosen_reward: float
    rejected_reward: float
    margin: float
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class RolloutMetrics:
    """A GRPO step's sampled replies (train.objective = "grpo", slideformer.engine.train.grpo)."""
    step: int
    reward_mean: float
    reward_std: float
    """Over every reply of the step."""
    reply_tokens: float
    """Mean tokens of a reply."""
    rollout_s: float
    """Time spent sampling the step's replies."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Span:
    """One unit of work on one resource: compute, h2d, d2h, optimizer or disk."""
    lane: str
    item: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Per-item spans of one step, times in seconds from the step start."""
    step: int
    spans: tuple[Span, ...]
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Log:
    level: str
    """info, warning or error."""
    message: str
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Progress:
    """Progress of a long preparation task (tokenization, loading)."""
    task: str
    done: int
    total: int | None
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class CheckpointSaved:
    step: int
    path: str
    best: bool = False
    """This checkpoint has the lowest validation loss so far (kept by output.keep_best)."""
    time: float = field(default_factory=_now)


EVENT_TYPES = {c.__name__: c for c in
               (RunState, StepMetrics, EvalMetrics, PairMetrics, RolloutMetrics, Timeline, Log,
                Progress, CheckpointSaved)}


def to_json(ev) -> str:
    d = dataclasses.asdict(ev)
    d["kind"] = type(ev).__name__
    return json.dumps(d)


def from_json(line: str):
    return _from_dict(json.loads(line))


def _from_dict(d: dict):
    cls = EVENT_TYPES[d.pop("kind")]
    if cls is Timeline:
        d["spans"] = tuple(Span(**s) for s in d["spans"])
    return cls(**d)


class EventSink:
    """Fan-out of events to callbacks and to an append-only ``events.jsonl`` (thread-safe)."""

    def __init__(self, path: Path | str | None = None, callbacks: list[Callable] | None = None):
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8", buffering=1)
            if self._file.tell() and not _ends_with_newline(path):
                self._file.write("\n")  # end a line torn by a killed process (readers skip it)
        self.callbacks = list(callbacks or [])

    def emit(self, ev) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write(to_json(ev) + "\n")
                except OSError:
                    # e.g. the disk is full: the file keeps what it has (readers skip a torn
                    # last line), and the run and its callbacks go on without it.
                    self._drop_file()
        for cb in self.callbacks:
            cb(ev)

    def _drop_file(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self._file = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._drop_file()


def _ends_with_newline(path: Path | str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def read_events(path: Path | str) -> list:
    """All complete events in an ``events.jsonl``.

    A line torn by a killed process (the last one, or one an :class:`EventSink` ended when it
    reopened the file) is skipped.
    """
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.endswith("\n"):
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.append(_from_dict(d))
    return out
