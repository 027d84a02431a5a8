"""Fused RMSNorm in Triton: forward, input gradient and weight gradient, one row per program.

For a row x (N,), weight w (N,) and eps, with fp32 maths:

    r = 1 / sqrt(mean(x^2) + eps)          (saved per row, fp32)
    n = x r,  rounded to x's dtype          (``round_n``: the reference rounds here, as Hugging
                                             Face does, when y is wanted in x's dtype)
    y = (offset + w) n                       (in the output dtype; ``offset`` 1: Gemma's norm,
                                             whose weights are stored as w - 1)

Backward, for dL/dy = dy (the rounding of n is the identity for gradients, as in autograd):

    g  = dy (offset + w)                     (dL/dn)
    dx = r (g - n mean(g n))                 since dn_j/dx_i = r (delta_ij - n_i n_j / N)
    dw = sum over rows of dy n

The reference (``layers.rms_norm``) keeps x in fp32 plus several (rows, N) temporaries per norm
and runs ~6 kernels each way; here the forward reads x and writes y, and the backward reads x
and dy and writes dx, with r recomputed nowhere. dw is summed per program over its rows
(``programs`` partial rows in fp32), then across programs by PyTorch.

The input may be fp32 (an fp32 residual stream) with ``out_dtype`` bf16, or bf16 q/k with an fp32
output: without ``round_n`` n stays fp32 and only y is rounded (the reference's ``out`` case, and
the Gemma norms': an offset, or Gemma 4's fp32 scaling, scale in fp32 and round once).
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from slideformer.engine.kernels.dispatch import count_launch


@triton.jit
def _rms_norm_fwd(x_ptr, x_stride, w_ptr, y_ptr, y_stride, r_ptr, N, eps, offset,
                  BLOCK: tl.constexpr, ROUND_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    n = x * r
    if ROUND_N:
        n = n.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) + offset
    tl.store(y_ptr + row * y_stride + cols, (w * n).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(r_ptr + row, r)


@triton.jit
def _rms_norm_bwd(dy_ptr, dy_stride, x_ptr, x_stride, w_ptr, r_ptr, dx_ptr, dx_stride,
                  dw_ptr, M, N, rows_per_program, offset, BLOCK: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
                  ROUND_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for j in range(0, rows_per_program):  # the last program's run may pass M: masked off
        i = first + j
        rm = m & (i < M)
        x = tl.load(x_ptr + i * x_stride + cols, mask=rm, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + i * dy_stride + cols, mask=rm, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + i, mask=i < M, other=0.0)
        n = x * r
        if WEIGHT_GRAD:
            if ROUND_N:
                dw += dy * n.to(x_ptr.dtype.element_ty).to(tl.float32)
            else:
                dw += dy * n
        g = dy * w
        dx = r * (g - n * (tl.sum(g * n, 0) / N))
        tl.store(dx_ptr + i * dx_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=rm)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + pid * N + cols, dw, mask=m)


def _settings(N: int) -> tuple[int, int]:
    """Block (the whole row, a power of two) and warps: more warps for longer rows so each
    thread holds at most ~16-32 fp32 values (Liger-Kernel's rule; untuned here)."""
    block = triton.next_power_of_2(N)
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


def _programs(M: int, device: torch.device) -> int:
    """Backward programs: a few per SM, each summing dw over a run of rows."""
    return min(M, 4 * _sms(device))


@functools.cache
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the interpreter's CPU tensors)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def rms_norm_fwd(x2: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype,
                 round_n: bool, offset: float = 0.0):
    """y (M, N) in ``out_dtype`` and r (M,) fp32 for rows x2 (M, N) with unit column stride."""
    M, N = x2.shape
    y = torch.empty(M, N, dtype=out_dtype, device=x2.device)
    r = torch.empty(M, dtype=torch.float32, device=x2.device)
    if M:
        block, warps = _settings(N)
        _rms_norm_fwd[(M,)](x2, x2.stride(0), w, y, N, r, N, eps, float(offset), BLOCK=block, ROUND_N=round_n,
                            num_warps=warps)
        count_launch("rms_norm_fwd")
    return y, r


def rms_norm_bwd(dy: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, r: torch.Tensor,
                 weight_grad: bool, round_n: bool, offset: float = 0.0):
    """dx (M, N) in x2's dtype and dw (N,) fp32 (None without ``weight_grad``)."""
    M, N = x2.shape
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    programs = max(_programs(M, x2.device), 1)
    rows = triton.cdiv(M, programs)
    dw = torch.empty(programs, N, dtype=torch.float32, device=x2.device) if weight_grad else dx
    if M:
        block, warps = _settings(N)
        _rms_norm_bwd[(programs,)](dy, dy.stride(0), x2, x2.stride(0), w, r, dx, N, dw, M, N, rows,
                                   float(offset), BLOCK=block, WEIGHT_GRAD=weight_grad, ROUND_N=round_n,
                                   num_warps=warps)
        count_launch("rms_norm_bwd")
    if not weight_grad:
        return dx, None
    return dx, dw.sum(0) if M else torch.zeros(N, dtype=torch.float32, device=x2.device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, N) with unit column stride (a view when possible, else a copy)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class RMSNorm(torch.autograd.Function):
    """y = w * rms-normalised x over the last dimension; see the module docstring."""

    @staticmethod
    def forward(ctx, x, w, eps: float, out_dtype: torch.dtype, round_n: bool,
                offset: float = 0.0):
        x2 = _rows(x)
        y, r = rms_norm_fwd(x2, w, eps, out_dtype, round_n, offset)
        ctx.save_for_backward(x2, w, r)
        ctx.x_shape, ctx.round_n, ctx.offset = x.shape, round_n, offset
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, r = ctx.saved_tensors
        dx, dw = rms_norm_bwd(_rows(dy), x2, w, r, ctx.needs_input_grad[1], ctx.round_n,
                              ctx.offset)
        return (dx.view(ctx.x_shape), None if dw is None else dw.to(w.dtype), None, None, None,
                None)
