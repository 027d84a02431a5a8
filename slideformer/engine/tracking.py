"""Experiment trackers (``output.report_to``): the per-step metrics of events.jsonl, mirrored.

Each tracker is its own library, imported only when a run names it and never a dependency of
the engine. They get the same values as ``events.jsonl`` under the same names (``train/loss``,
``train/lr``, ..., ``eval/val_loss``), keyed by the optimizer step, and the run's config.
Where they write:

- tensorboard: ``<run dir>/tensorboard`` (``tensorboard --logdir <run dir>``), through
  ``torch.utils.tensorboard`` (needs the ``tensorboard`` package).
- wandb: project "slideformer", the run folder's name; ``WANDB_MODE=offline`` keeps it on disk
  (``wandb sync`` uploads it later), files under ``<run dir>/wandb``.
- mlflow: experiment "slideformer" in ``MLFLOW_TRACKING_URI`` or, when unset, the SQLite store
  ``<run dir>/mlflow.db`` that MLflow recommends (``mlflow ui --backend-store-uri
  sqlite:///<run dir>/mlflow.db``; its file store is deprecated).
- trackio: project "slideformer", local-first (its own store; ``trackio show``).

A tracker that fails while the run goes on (a network error, a full disk) is dropped with one
warning: tracking never stops training.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

from slideformer.engine.errors import UserError
from slideformer.engine.events import EvalMetrics, PairMetrics, RolloutMetrics, StepMetrics

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
"""output.report_to values."""
PROJECT = "slideformer"
_MODULE = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb",
           "mlflow": "mlflow"}
_STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time", "data_time",
                "peak_vram", "peak_ram")


def check_installed(names: tuple[str, ...]) -> None:
    """Refuse a tracker whose library is missing, before a run loads anything."""
    for name in names:
        if importlib.util.find_spec(_MODULE[name]) is None:
            raise UserError("output.report_to", f"names {name}, but its library is not "
                            "installed", f"pip install {name}, or remove it from "
                            "output.report_to")


def metrics_of(ev) -> dict[str, float] | None:
    """The tracked values of an event (None: the event is not tracked); missing ones left out."""
    if isinstance(ev, StepMetrics) and not ev.skipped:
        return {f"train/{k}": float(v) for k in _STEP_FIELDS
                if (v := getattr(ev, k)) is not None}
    if isinstance(ev, EvalMetrics):
        return {"eval/val_loss": float(ev.val_loss)}
    if isinstance(ev, PairMetrics):
        return {f"pairs/{k}": float(getattr(ev, k))
                for k in ("accuracy", "chosen_reward", "rejected_reward", "margin")}
    if isinstance(ev, RolloutMetrics):
        return {f"grpo/{k}": float(getattr(ev, k))
                for k in ("reward_mean", "reward_std", "reply_tokens", "rollout_s")}
    return None


class _TensorBoard:
    def __init__(self, run_dir: Path, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in config.items()))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, name: str, config: dict):
        import wandb
        self.run = wandb.init(project=PROJECT, name=name, dir=str(run_dir), config=config,
                              resume="allow", id=_run_id(run_dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, name: str, config: dict):
        import mlflow
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(PROJECT)
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step, run_id=self.run.info.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


class _Trackio:
    def __init__(self, run_dir: Path, name: str, config: dict):
        import trackio
        self.trackio = trackio
        trackio.init(project=PROJECT, name=name, config=config, resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


_OPEN = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow, "trackio": _Trackio}


def _run_id(run_dir: Path) -> str:
    """A stable id per run folder, so a resumed run continues the same tracked run."""
    import hashlib
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class Trackers:
    """An event callback that forwards the tracked metrics to each tracker of the run."""

    def __init__(self, names: tuple[str, ...], run_dir: Path, config: dict,
                 warn: Callable[[str], None]):
        self.warn = warn
        flat = _flatten(config)
        self.open: dict[str, object] = {}
        for name in names:
            try:
                self.open[name] = _OPEN[name](run_dir, run_dir.name, flat)
            except Exception as e:  # noqa: BLE001 -- a tracker's own failure, reported once
                warn(f"output.report_to: {name} could not start ({type(e).__name__}: {e}); "
                     "the run goes on without it")

    def __call__(self, ev) -> None:
        values = metrics_of(ev)
        if values is None:
            return
        for name, tracker in list(self.open.items()):
            try:
                tracker.log(ev.step, values)
            except Exception as e:  # noqa: BLE001
                del self.open[name]
                self.warn(f"output.report_to: {name} failed ({type(e).__name__}: {e}); "
                          "the run goes on without it")

    def close(self) -> None:
        for name, tracker in self.open.items():
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                self.warn(f"output.report_to: {name} did not close cleanly ({e})")
        self.open = {}


def _flatten(config: dict, prefix: str = "") -> dict:
    """``{"optim": {"lr": 1e-4}}`` -> ``{"optim.lr": 1e-4}`` (trackers show flat parameters)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
