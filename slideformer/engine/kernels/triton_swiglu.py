"""Fused SwiGLU in Triton: y = silu(g) * u, elementwise over the MLP's gate and up projections.

With sigma = sigmoid(g) and silu(g) = g sigma, for dL/dy = dy:

    dg = dy u sigma (1 + g (1 - sigma))        d silu / dg = sigma + g sigma (1 - sigma)
    du = dy silu(g)

The reference (``F.silu(g) * u``) keeps g, u and silu(g) for its backward (three (B, T, I)
tensors) and rounds silu(g) before the product; here the backward keeps g and u and recomputes
sigma, with fp32 maths rounded once per output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slideformer.engine.kernels.dispatch import count_launch

BLOCK = 1024
"""Elements per program (untuned: an elementwise op bound by memory bandwidth)."""


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(dg_ptr + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty),
             mask=m)
    tl.store(du_ptr + offs, (dy * g * sig).to(du_ptr.dtype.element_ty), mask=m)


def swiglu_fwd(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for contiguous g, u of one shape and dtype."""
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](g, u, y, n, BLOCK=BLOCK)
        count_launch("swiglu_fwd")
    return y


def swiglu_bwd(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """(dL/dg, dL/du) for contiguous dy, g, u."""
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        _swiglu_bwd[(triton.cdiv(n, BLOCK),)](dy, g, u, dg, du, n, BLOCK=BLOCK)
        count_launch("swiglu_bwd")
    return dg, du


class SwiGLU(torch.autograd.Function):
    """silu(g) * u; see the module docstring for the gradients."""

    @staticmethod
    def forward(ctx, g, u):
        assert g.shape == u.shape and g.dtype == u.dtype, (g.shape, u.shape, g.dtype, u.dtype)
        g, u = g.contiguous(), u.contiguous()
        ctx.save_for_backward(g, u)
        return swiglu_fwd(g, u)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return swiglu_bwd(dy.contiguous(), g, u)
