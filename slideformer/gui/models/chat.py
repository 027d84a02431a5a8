"""The models the Chat page offers, without Qt: the chosen model, and every run's results.

A run offers its ``final/`` folder and each complete checkpoint (``checkpoints/step-N``), newest
run first; the run folders are the Runs page's (:func:`slideformer.gui.models.runs.scan_runs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.api import checkpoints
from slideformer.gui.models.runs import RunSummary


@dataclass(frozen=True)
class ModelChoice:
    """One entry of a Chat pane's model list."""

    label: str
    path: str
    kind: str
    """model (the chosen or a picked model folder), final (a run's result) or checkpoint."""


def run_choices(runs: list[RunSummary]) -> list[ModelChoice]:
    """Each run's final model, then its checkpoints, newest first."""
    out = []
    for run in runs:
        if run.has_final:
            out.append(ModelChoice(f"{run.name} · final", str(run.path / "final"), "final"))
        for step in checkpoints(Path(run.path) / "checkpoints"):
            out.append(ModelChoice(f"{run.name} · {step.name}", str(step), "checkpoint"))
    return out


def model_choices(current: str | None, runs: list[RunSummary],
                  picked: list[str] = ()) -> list[ModelChoice]:
    """The chosen model first, then the runs' results, then folders picked by hand."""
    out = []
    if current:
        out.append(ModelChoice(f"{Path(current).name} (chosen model)", current, "model"))
    out += run_choices(runs)
    seen = {c.path for c in out}
    out += [ModelChoice(Path(p).name, p, "model") for p in picked if p not in seen]
    return out
