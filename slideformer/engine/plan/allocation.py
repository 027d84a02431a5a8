"""A block of memory the planner counts (tier, purpose, phase), and a run's data types."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slideformer.engine.runtime.shapes import moment_numel


@dataclass(frozen=True)
class Allocation:
    """One block of memory the run holds."""
    tier: str
    """gpu, host or disk (on the CPU backend "gpu" buffers live in host memory)."""
    purpose: str
    bytes: int
    detail: str
    """How the size follows from the model and the settings."""
    phase: str = "run"
    """When it is held (see the module docstring)."""


@dataclass(frozen=True)
class Precision:
    """Data types of the run."""
    compute: torch.dtype
    """Weights on the device and activations: bfloat16 (CUDA) or float32."""
    moments: torch.dtype
    """AdamW m and v on the host: float32, bfloat16, or int8 for 8-bit blocks with a scale each
    (slideformer.engine.runtime.moments8)."""
    file_bytes: int = 2
    """Bytes per parameter in the model's safetensors files."""
    residual: torch.dtype | None = None
    """The residual stream between layers, its gradients, the activation checkpoints and the
    RoPE tables (train.precision: float32 for autocast); None: the compute dtype."""
    fp8: bool = False
    """train.precision = "fp8": the dense MLP's projections in row-wise FP8 (kernels.fp8)."""

    @property
    def c(self) -> int:
        return self.compute.itemsize

    @property
    def r(self) -> int:
        """Bytes per element of the residual stream."""
        return (self.residual or self.compute).itemsize

    @property
    def wide(self) -> bool:
        """The residual stream is wider than the compute dtype."""
        return self.r > self.c

    @property
    def mo(self) -> int:
        """Bytes per moment value, a block's scale left out (:meth:`moment_bytes` has it)."""
        return self.moments.itemsize

    def moment_bytes(self, numel: int) -> int:
        """Bytes of one AdamW moment of an item of ``numel`` parameters (8-bit: whole blocks,
        each with its fp32 scale)."""
        return moment_numel(numel, self.moments) * self.moments.itemsize


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
