"""Which path a layer op takes (fused Triton kernel or PyTorch), and a count of kernel launches.

The model code (slideformer.engine.models.layers) asks :func:`use_triton` before each RMSNorm,
RoPE and SwiGLU and calls the fused op here when it answers yes: CUDA tensors, triton
importable (CUDA builds of PyTorch ship it; it is not a dependency of the package) and
``SLIDEFORMER_TRITON`` not ``0`` (the same switch turns off the cross-entropy kernel). The
PyTorch code in ``layers`` is the reference and the path everywhere else.

``LAUNCHES`` counts the fused launches by op name, so a test or a benchmark can tell a kernel
that ran from a silent fall-back.
"""
from __future__ import annotations

import functools
import os
from collections import Counter

import torch

ENV = "SLIDEFORMER_TRITON"
"""``SLIDEFORMER_TRITON=0`` in the environment: every op on its PyTorch path."""
LAUNCHES: Counter[str] = Counter()
"""Fused launches so far, by op name (``rms_norm_fwd``, ``rope_bwd``, ``flex_attention``...)."""


def count_launch(name: str) -> None:
    LAUNCHES[name] += 1


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (CPU installs and CI have none)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_enabled() -> bool:
    """Triton kernels are allowed in this process (installed, not switched off)."""
    return os.environ.get(ENV) != "0" and triton_available()


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` takes its fused Triton kernel: CUDA tensors, or any under Triton's
    interpreter (``TRITON_INTERPRET=1`` runs the kernels on CPU tensors: the tests' way to check
    them without a GPU)."""
    on_device = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and triton_enabled()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
             out: torch.dtype | None = None) -> torch.Tensor:
    """Fused ``layers.rms_norm``. ``out`` None or x's dtype: Hugging Face's rounding (the
    normalised value rounded to x's dtype, y in promote(x, w)); another dtype: the scaling in
    fp32, rounded once to ``out`` (an fp32 residual stream feeding bf16 matmuls)."""
    from slideformer.engine.kernels.triton_norm import RMSNorm
    if out is None or out == x.dtype:
        return RMSNorm.apply(x, w, eps, torch.promote_types(x.dtype, w.dtype), True)
    return RMSNorm.apply(x, w, eps, out, False)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out: torch.dtype | None = None) -> torch.Tensor:
    """Fused ``layers.apply_rope`` for tables made by ``layers.rope_tables``, in fp32, rounded
    once to ``out`` (default: x's dtype)."""
    from slideformer.engine.kernels.triton_rope import RoPE
    return RoPE.apply(x, cos, sin, out or x.dtype)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Fused ``silu(g) * u``."""
    from slideformer.engine.kernels.triton_swiglu import SwiGLU
    return SwiGLU.apply(g, u)
