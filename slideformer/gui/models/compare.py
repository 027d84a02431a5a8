"""Comparing runs, without Qt: their loss curves and the settings they differ in.

The Runs page overlays the curves of the runs chosen in its list and shows, beside them, every
config key whose value is not the same in all of them (config.toml as the engine wrote it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.api import (CONFIG_FILE, EVENTS_FILE, EvalMetrics, StepMetrics, UserError,
                                    config_to_dict, load_config, read_events)


@dataclass(frozen=True)
class Curve:
    """One run's training and validation losses by step."""

    name: str
    steps: tuple[int, ...]
    losses: tuple[float, ...]
    val_steps: tuple[int, ...]
    val_losses: tuple[float, ...]


def read_curve(run_dir: Path | str) -> Curve:
    """The losses in a run's events.jsonl; a step reported twice (a resumed run repeats the
    steps after its checkpoint) counts with its last report."""
    run_dir = Path(run_dir)
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    try:
        events = read_events(run_dir / EVENTS_FILE)
    except OSError:
        events = []
    for ev in events:
        if isinstance(ev, StepMetrics) and ev.loss is not None and not ev.skipped:
            train[ev.step] = ev.loss
        elif isinstance(ev, EvalMetrics):
            val[ev.step] = ev.val_loss
    ts, vs = sorted(train), sorted(val)
    return Curve(run_dir.name, tuple(ts), tuple(train[s] for s in ts), tuple(vs),
                 tuple(val[s] for s in vs))


def config_differences(run_dirs: list[Path]) -> list[tuple[str, list[str]]]:
    """``[(section.key, [value of each run])]`` for every key not equal in all runs, in the
    config's order; a run whose config.toml cannot be read shows "?" for each key."""
    flat = [_flat_config(Path(d)) for d in run_dirs]
    keys = list(dict.fromkeys(k for f in flat if f for k in f))
    rows = []
    for key in keys:
        values = [f.get(key, "—") if f else "?" for f in flat]
        if len(set(values)) > 1:
            rows.append((key, values))
    return rows


def _flat_config(run_dir: Path) -> dict[str, str] | None:
    try:
        data = config_to_dict(load_config(run_dir / CONFIG_FILE))
    except UserError:
        return None
    out = {}
    for section, values in data.items():
        for key, value in values.items():
            out[f"{section}.{key}"] = _text(value)
    return out


def _text(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def compare(run_dirs: list[str]) -> tuple[list[Curve], list[tuple[str, list[str]]]]:
    """What the compare view shows (one call for the worker thread)."""
    dirs = [Path(d) for d in run_dirs]
    return [read_curve(d) for d in dirs], config_differences(dirs)
