"""Disk space for a run, checked before it trains: the trained steps need somewhere to go.

A run writes checkpoints (its whole host state) and, at the end, the final model. A disk that
cannot hold one checkpoint and the final model would lose every trained step at the first
save: refused with the sizes. One with room for fewer checkpoints than ``train.keep_checkpoints``
keeps (one more is written before the oldest goes) is warned about.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch

from slideformer.engine.config import format_bytes
from slideformer.engine.devices import torch_dtype
from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.runtime.lora import is_adapter


def export_bytes(spec: ModelSpec, host: dict, merged: bool | None) -> int:
    """What ``final/`` takes: the model in its checkpoint dtype (``merged`` None: a full run),
    or the adapters in fp32 and, when ``merged``, the merged model beside them."""
    size = (torch_dtype(spec.torch_dtype) or torch.bfloat16).itemsize
    if merged is None:
        return spec.num_params * size
    adapters = sum(item.numel for name, item in host.items() if is_adapter(name)) * 4
    return adapters + (spec.num_params * size if merged else 0)


def check_space(run_dir: Path, checkpoint: int, final: int, keep: int, resume: bool,
                warn: Callable[[str], None]) -> None:
    """Refuse, or warn, as the module docstring says (``resume``: the run's own checkpoints
    count as room, since each new one replaces an old one)."""
    root = run_dir if run_dir.exists() else run_dir.parent
    free = shutil.disk_usage(root).free
    old = run_dir / "checkpoints"
    if resume and old.is_dir():
        free += sum(f.stat().st_size for f in old.rglob("*") if f.is_file())
    if free < checkpoint + final:
        raise UserError(run_dir, f"is on a disk with {format_bytes(free)} free, but the run "
                        f"needs {format_bytes(checkpoint + final)} there: a checkpoint of "
                        f"{format_bytes(checkpoint)} and the final model of {format_bytes(final)}",
                        "free disk space, or set output.run_dir to a folder on a larger disk")
    keep = max(1, keep)
    if free < (keep + 1) * checkpoint + final:
        warn(f"{run_dir} has {format_bytes(free)} free: room for fewer than the {keep} "
             f"checkpoints train.keep_checkpoints keeps ({format_bytes(checkpoint)} each, one "
             f"more while a new one is written) and the final model ({format_bytes(final)}); "
             "lower train.keep_checkpoints or free disk space")
