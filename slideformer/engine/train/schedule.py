"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay."""
from __future__ import annotations

import math

from slideformer.engine.config import OptimConfig, TrainConfig
from slideformer.engine.errors import UserError

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """Learning rate of 1-based optimizer ``step`` out of ``total``.

    Warmup ramps linearly from lr/warmup to lr over ``warmup_steps``; the decay then runs from
    lr to ``lr * min_lr_ratio`` at the last step.
    """
    if cfg.schedule not in SCHEDULES:
        raise UserError("optim.schedule", f"unknown schedule {cfg.schedule!r}",
                        f"use one of: {', '.join(SCHEDULES)}")
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(total - cfg.warmup_steps, 1)
    frac = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * frac
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def run_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of a run: ``max_steps``, or ``epochs`` over the data when it is 0."""
    return cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
