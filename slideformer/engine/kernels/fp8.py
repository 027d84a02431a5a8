"""Row-wise FP8 projections (``train.precision = "fp8"``).

The dense feed-forward's projections (:data:`PROJECTIONS`, through ``models.layers.linear``)
compute y = x W^T with both operands
in float8 e4m3 and a scale per row: each token's row of x and each output row of W scaled so
its largest magnitude is e4m3's 448, the product accumulated in fp32 and rescaled
(``torch._scaled_mm``), as torchao's row-wise float8 training does. The backward's dL/dx =
dL/dy W takes dL/dy per token and W per input column the same way. dL/dW = dL/dy^T x stays in
the compute dtype with fp32 accumulation (torchao's "row-wise, weight gradient in high
precision" recipe): the weight update is as exact as in bf16 training, and the two FP8 products
are the forward and the input gradient, two thirds of a projection's matmul FLOPs.

Only the dense feed-forward's projections take it (:data:`PROJECTIONS`: where it measured
faster). What stays in bf16: the attention's projections and its own products (SDPA /
FlexAttention), the experts' grouped matmuls, LoRA's adapters, the LM head and its loss, and any
projection whose dimensions are not multiples of 16 (the GPU's FP8 kernels need them).

FP8 matmuls need tensor cores that have them: NVIDIA compute capability 8.9 (Ada) or 9.0+
(Hopper, Blackwell). :func:`unsupported` says why a device cannot; the trainer refuses the
setting there. ``torch._scaled_mm`` also runs on the CPU (emulated), which the tests use to
check the numerics against a PyTorch reference.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_ON = contextvars.ContextVar("slideformer_fp8", default=False)


def unsupported(device: torch.device | str) -> str | None:
    """Why ``device`` cannot run FP8 projections, or None when it can."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (f"FP8 matmuls need an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: "
                f"RTX 40xx, L4, L40, H100, H200, B200); this run is on the {dev.type}")
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    major, minor = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    if (major, minor) < (8, 9):
        return (f"{name} (compute capability {major}.{minor}) has no "
                "FP8 tensor cores (8.9+ needed: RTX 40xx, L4, L40, H100, H200, B200)")
    try:  # row-wise scaling is newer than FP8 itself: not every PyTorch / cuBLAS has it for
        ones = torch.ones(16, 16, dtype=torch.bfloat16, device=dev)  # every FP8 GPU
        matmul(ones, ones, torch.bfloat16)
    except (RuntimeError, NotImplementedError, ImportError) as e:
        return (f"{name}: this PyTorch ({torch.__version__}) cannot run row-wise FP8 matmuls "
                f"on it ({str(e).splitlines()[0][:120]})")
    return None


@contextlib.contextmanager
def enabled(on: bool = True):
    """Projections computed inside run in FP8 (those :func:`eligible`)."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def active() -> bool:
    return _ON.get()


PROJECTIONS = "mlp."
"""The projections FP8 takes: the dense feed-forward's (gate, up, down; Phi-3's fused gate-up).
Measured on an H100 (benchmarks/fp8_linear.py, 8K tokens, forward + dL/dx + dL/dW with the
quantisation, 2026-12-07): the MLP's matrices of the 3B and 8B shapes ran 0.99-1.23x bf16's
speed in FP8, the attention's 0.31-0.95x (their products are smaller, and quantising the
operands costs as much as the faster product saves), so those stay bf16."""


def eligible(x: torch.Tensor, w: torch.Tensor, name: str) -> bool:
    """Whether x W^T of projection ``name`` runs in FP8 here: FP8 on, one of
    :data:`PROJECTIONS`, bf16 operands (the kernel's row-wise output is bf16), and on a GPU
    both dimensions of W multiples of 16."""
    if not _ON.get() or w.dtype != torch.bfloat16 or x.dtype != w.dtype \
            or not name.startswith(PROJECTIONS):
        return False
    return not w.is_cuda or (w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0)


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales (rows, 1)) of a 2-D tensor, each row scaled so that its largest
    magnitude maps to 448 (an all-zero row keeps scale 1). On the GPU one Triton kernel
    (``kernels.triton_fp8``) computes exactly this."""
    from slideformer.engine.kernels import dispatch
    if t.is_cuda and dispatch.triton_enabled():  # SLIDEFORMER_TRITON=0: the PyTorch ops
        from slideformer.engine.kernels.triton_fp8 import rowwise_e4m3
        return rowwise_e4m3(t)
    return rowwise_torch(t)


def rowwise_torch(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rowwise` in PyTorch ops (the CPU's path, the GPU kernel's reference)."""
    amax = t.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax * (1 / E4M3_MAX), torch.ones_like(amax))
    # one row-major fp32 copy (a transposed operand too: the GPU kernel takes row-major A and
    # column-major B), scaled and clamped in place: 5 bytes an element at the peak
    q = t.to(torch.float32, memory_format=torch.contiguous_format)
    return q.div_(scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """a @ b^T for a (M, K) and b (N, K), each quantised row-wise (:func:`rowwise`): the first
    operand row-major, the second (its transpose) column-major, as the GPU's kernel needs."""
    aq, sa = rowwise(a)
    bq, sb = rowwise(b)
    return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out)


class Fp8Linear(torch.autograd.Function):
    """``F.linear(x, w, b)`` with the forward and dL/dx in FP8 (module docstring); dL/dW in the
    compute dtype, returned, or with ``dest`` added to that fp32 buffer inside the matmul
    (models.layers.GradInto)."""

    @staticmethod
    def forward(ctx, x, w, b, dest):
        from slideformer.engine.kernels import dispatch
        ctx.save_for_backward(x, w)
        ctx.dest, ctx.add = dest, dispatch.add_product_
        y = matmul(x.reshape(-1, w.shape[1]), w, x.dtype)
        y = y.view(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        go2 = go.reshape(-1, w.shape[0])
        gx = matmul(go2, w.t(), go.dtype).view(*go.shape[:-1], w.shape[1]) \
            if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.dest is not None:
            ctx.add(ctx.dest, go2.t(), x.reshape(-1, w.shape[1]))
        elif ctx.needs_input_grad[1]:
            gw = go2.t().mm(x.reshape(-1, w.shape[1]))
        gb = go2.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           dest: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) in FP8 (:class:`Fp8Linear`)."""
    return Fp8Linear.apply(x, w, b, dest)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`matmul`'s product written out in PyTorch (for the tests): the operands rounded
    to e4m3 on their row-wise scales, multiplied in fp32, rescaled."""
    def q(t):
        amax = t.abs().amax(dim=1, keepdim=True).float()
        s = torch.where(amax > 0, amax * (1 / E4M3_MAX), torch.ones_like(amax))
        return (t.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * s
    x2 = x.reshape(-1, w.shape[1])
    return (q(x2) @ q(w).t()).to(x.dtype).view(*x.shape[:-1], w.shape[0])

