"""The devices and number formats a run config may name, checked in one place.

``train.device`` is ``auto`` (a CUDA GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``;
``train.compute_dtype`` is ``auto`` (bfloat16 on a GPU, float32 on the CPU), ``bfloat16`` or
``float32``; ``optim.moments_dtype`` is ``float32``, ``bfloat16`` or ``int8`` (8-bit blocks,
slideformer.engine.runtime.moments8); ``train.precision`` is
``autocast`` (an fp32 residual stream under bf16 compute), ``bf16`` or ``fp8`` (the dense
feed-forward's projections in row-wise FP8 on a GPU with FP8 tensor cores:
slideformer.engine.kernels.fp8). The trainer, the planner and
the backends all ask here, so a name one accepts is accepted by all.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from slideformer.engine.errors import UserError

if TYPE_CHECKING:  # the checks need no torch (the planner runs without it)
    import torch

TRAIN_DTYPES = ("float32", "bfloat16")
"""Formats of compute."""
MOMENTS_DTYPES = TRAIN_DTYPES + ("int8",)
"""Formats of the AdamW moments."""
PRECISIONS = ("autocast", "bf16", "fp8")
"""train.precision values."""
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def device_kind(device: str, gpu: bool) -> str:
    """``cuda`` or ``cpu``: what ``train.device`` runs on, ``auto`` meaning a GPU if ``gpu``.

    Raises:
        UserError: ``device`` names no device.
    """
    if not _DEVICE.fullmatch(device):
        raise UserError("train.device", f"{device!r} is not a device",
                        "use auto, cuda, cuda:N or cpu")
    if device == "auto":
        return "cuda" if gpu else "cpu"
    return "cpu" if device == "cpu" else "cuda"


def compute_dtype_name(name: str, kind: str) -> str:
    """The compute format of ``train.compute_dtype`` on a ``kind`` (cuda or cpu) device."""
    if name == "auto":
        return "bfloat16" if kind == "cuda" else "float32"
    if name not in TRAIN_DTYPES:
        raise UserError("train.compute_dtype", f"{name!r} is not supported",
                        "use auto, bfloat16 or float32")
    return name


def residual_dtype_name(precision: str, compute: str) -> str:
    """The format of the residual stream (hidden states between layers, their gradients and the
    RoPE tables) for ``train.precision`` over the compute format ``compute``."""
    if precision not in PRECISIONS:
        raise UserError("train.precision", f"{precision!r} is not supported",
                        "use \"autocast\" (fp32 residual stream), \"bf16\" or \"fp8\" (FP8 "
                        "projections on a GPU that has FP8 tensor cores)")
    return "float32" if precision == "autocast" else compute


def check_fp8(compute: str, device, spec=None) -> None:
    """Refuse ``train.precision = "fp8"`` where it cannot run: float32 compute, a model whose
    feed-forward is experts only (``spec``: nothing would run in FP8), or a device without FP8
    matmuls (slideformer.engine.kernels.fp8.unsupported)."""
    from slideformer.engine.kernels.fp8 import unsupported
    if spec is not None and not spec.dense_mlp_width:
        raise UserError("train.precision", f"is \"fp8\", but this {spec.model_type} model has no "
                        "dense feed-forward: FP8 runs only the dense MLP's projections, and a "
                        "mixture's experts stay bf16, so the run would be bf16 all the same",
                        "use train.precision = \"bf16\"")
    if compute != "bfloat16":
        raise UserError("train.precision", f"is \"fp8\" but train.compute_dtype is {compute}",
                        "use train.compute_dtype = \"bfloat16\" (fp8 replaces its projections), "
                        "or train.precision = \"bf16\"")
    why = unsupported(device)
    if why:
        raise UserError("train.precision", f"is \"fp8\", but {why}",
                        "use train.precision = \"bf16\" (or \"autocast\") on this machine")


def moments_dtype_name(name: str) -> str:
    """``optim.moments_dtype``, checked."""
    if name not in MOMENTS_DTYPES:
        raise UserError("optim.moments_dtype", f"{name!r} is not supported",
                        "use \"float32\" (exact), \"bfloat16\" or \"int8\" (8-bit blocks)")
    return name


def moments_torch_dtype(name: str) -> torch.dtype:
    """The dtype of the tensors that hold the moments ``optim.moments_dtype`` names (checked):
    ``torch.int8`` stands for the 8-bit block format (codes and scales as bytes)."""
    import torch

    name = moments_dtype_name(name)
    return torch.int8 if name == "int8" else torch_dtype(name)


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a format name (``float32``, ``bfloat16``, ``float16``, as in a model's
    ``config.json``), or None for another name."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}.get(name)
