"""Which path a layer op takes (fused Triton kernel or PyTorch), and a count of kernel launches.

The model code (slideformer.engine.models.layers) asks :func:`use_triton` before each RMSNorm,
RoPE and SwiGLU and calls the fused op here when it answers yes: CUDA tensors, triton
importable (CUDA builds of PyTorch ship it; it is not a dependency of the package) and
``SLIDEFORMER_TRITON`` not ``0`` (the same switch turns off the cross-entropy kernel). The
PyTorch code in ``layers`` is the reference and the path everywhere else.

:func:`kernel_path` is the whole decision for a run, from the same predicates the ops and the
executor's attention mask (``attention.document_mask``) ask: the planner predicts memory and
speed with it, so the plan and the run cannot take different kernels.

``LAUNCHES`` counts the fused launches by op name, so a test or a benchmark can tell a kernel
that ran from a silent fall-back.
"""
from __future__ import annotations

import functools
import os
from collections import Counter
from dataclasses import dataclass

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


def fused_ops_on(device: str) -> bool:
    """Whether RMSNorm, RoPE and SwiGLU on tensors of ``device`` (``cuda``, ``cpu``) take their
    fused Triton kernels: CUDA, or any device under Triton's interpreter (``TRITON_INTERPRET=1``
    runs the kernels on CPU tensors: the tests' way to check them without a GPU)."""
    on_device = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and triton_enabled()


FP32_GRADS_ENV = "SLIDEFORMER_FP32_GRADS"
"""``SLIDEFORMER_FP32_GRADS=0``: weight gradients leave the matmul in the compute dtype and are
added to their fp32 buffer afterwards, as on the CPU (for side-by-side timings)."""


@functools.cache
def _has_fp32_addmm() -> bool:
    """This torch has the fp32-output addmm overload (asked once: it runs per layer)."""
    return "dtype_out" in torch.ops.aten.addmm.overloads()


@functools.cache
def _fp32_addmm_runs() -> bool:
    try:
        a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        c = torch.ones(2, 2, device="cuda")
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return bool((c == 3).all())
    except (RuntimeError, TypeError):
        return False


def fp32_accumulate(device: str) -> bool:
    """Whether weight gradients on ``device`` accumulate inside their matmul: cuBLAS adds the
    16-bit product to the fp32 gradient buffer in its epilogue (``torch.addmm(..., out_dtype=
    float32, out=buffer)``; CUDA builds of torch with the ``addmm.dtype_out`` overload). Else
    the product is formed in the compute dtype and added to the buffer afterwards: an extra
    pass over the gradient, and the product rounded to bf16 first. Without a GPU in this
    process (planning for one) the overload's presence answers."""
    if device != "cuda" or os.environ.get(FP32_GRADS_ENV) == "0":
        return False
    if not _has_fp32_addmm():
        return False
    return _fp32_addmm_runs() if torch.cuda.is_available() else True


def add_product_(dest: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """dest (fp32) += a @ b for 16-bit a, b: inside the matmul where fp32_accumulate says so."""
    if dest.is_cuda and a.dtype != torch.float32 and fp32_accumulate("cuda"):
        torch.addmm(dest, a, b, out_dtype=torch.float32, out=dest)
    else:
        dest += (a @ b).float()


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` takes its fused Triton kernel (:func:`fused_ops_on`)."""
    return fused_ops_on(x.device.type)


ATTENTION = ("causal", "flex", "mask")
"""Attention kernels of a decoder layer: SDPA ``is_causal`` (flash) for unpacked rows,
FlexAttention with a document BlockMask, SDPA on a boolean (B, 1, T, T) document mask."""

PATHS = tuple(f"{ops}+{att}" for ops in ("fused", "torch") for att in ATTENTION)
"""Every :attr:`KernelPath.key`."""


@dataclass(frozen=True)
class KernelPath:
    """The kernels a run's decoder layers take (what the planner's memory and speed assume)."""
    fused_ops: bool
    """RMSNorm, RoPE and SwiGLU run as Triton kernels."""
    fused_ce: bool
    """The LM head's cross-entropy runs as a Triton kernel (kernels.linear_ce)."""
    attention: str
    """One of ATTENTION."""
    fp32_grads: bool = False
    """Weight gradients (decoder layers' projections, the LM head) accumulate inside their
    matmul (fp32_accumulate): no compute-dtype copy of them exists."""
    cuda: bool = True
    """The layers run on CUDA (where SDPA has no fused kernel for heads wider than
    kernels.attention.FLASH_HEAD_DIM)."""

    @property
    def key(self) -> str:
        """``fused+flex``, ``torch+mask``...: the name of a measured efficiency."""
        return f"{'fused' if self.fused_ops else 'torch'}+{self.attention}"

    def describe(self) -> str:
        ops = "fused Triton" if self.fused_ops else "PyTorch ops"
        att = {"causal": "SDPA causal (flash)", "flex": "FlexAttention (document BlockMask)",
               "mask": "SDPA on a boolean document mask"}[self.attention]
        return f"{ops} + {att}"


def kernel_path(device: str, head_dim: int, packed: bool) -> KernelPath:
    """The kernels a run on ``device`` takes in this process (module docstring): ``packed``
    micro-batches carry document masks; FlexAttention needs CUDA and a power-of-two head
    dimension (slideformer.engine.kernels.attention.flex_available)."""
    from slideformer.engine.kernels.attention import flex_available  # it imports this module
    fused = fused_ops_on(device)
    attention = "causal" if not packed else "flex" if flex_available(device, head_dim) else "mask"
    return KernelPath(fused_ops=fused, fused_ce=fused and device == "cuda", attention=attention,
                      fp32_grads=fp32_accumulate(device), cuda=device == "cuda")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
             out: torch.dtype | None = None, offset: float = 0.0,
             fp32: bool = False) -> torch.Tensor:
    """Fused ``layers.rms_norm``. ``out`` None or x's dtype: Hugging Face's rounding (the
    normalised value rounded to x's dtype, y in promote(x, w)); another dtype: the scaling in
    fp32, rounded once to ``out`` (an fp32 residual stream feeding bf16 matmuls). An
    ``offset`` (Gemma's 1 + w) or ``fp32`` (Gemma 4's norm) scales in fp32 and rounds once to
    ``out`` or x's dtype, as the reference does."""
    from slideformer.engine.kernels.triton_norm import RMSNorm
    w = w.contiguous()  # the kernels read the weight as one run of N values
    if offset or fp32:
        return RMSNorm.apply(x, w, eps, out or x.dtype, False, float(offset))
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
