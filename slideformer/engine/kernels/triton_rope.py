"""Fused rotary embedding in Triton: one program per (batch, position) rotates every head.

``layers.rope_tables`` builds cos and sin (B, 1, T, hd) from angles ``cat(f, f)``, so both
halves of a table row are equal: with c = cos f, s = sin f (hd/2,) and x = [x1, x2] per head,

    y1 = x1 c - x2 s,    y2 = x2 c + x1 s               (x * cos + rotate_half(x) * sin)

a rotation of each pair (x1_j, x2_j) by f_j. Its gradient is the rotation by -f_j:

    dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s           (the forward kernel with s -> -s)

The kernel reads the first half of each table row only, which is why it serves tables from
``rope_tables`` and nothing else. The reference makes 4 temporaries of x's size and rounds
three times in bf16; here x is read once and y written once, with fp32 maths rounded once (to
``out``: x's dtype, or fp32 for an fp32 attention input).
q and k are (B, heads, T, hd) views with any strides (the projections' transposes) and the
output keeps them, so attention sees the same layout as with the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slideformer.engine.kernels.dispatch import count_launch


@triton.jit
def _rope(x_ptr, y_ptr, cos_ptr, sin_ptr, T, heads, sxb, sxh, sxt, syb, syh, syt, scb, sct,
          HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
          INVERSE: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    dm = d < HALF
    c = tl.load(cos_ptr + b * scb + t * sct + d, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + b * scb + t * sct + d, mask=dm, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    m = (h[:, None] < heads) & dm[None, :]
    x_off = b * sxb + t * sxt + h[:, None] * sxh + d[None, :]  # (BLOCK_H, BLOCK_D)
    y_off = b * syb + t * syt + h[:, None] * syh + d[None, :]
    x1 = tl.load(x_ptr + x_off, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_off, (x1 * c[None, :] - x2 * s[None, :]).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(y_ptr + y_off + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(y_ptr.dtype.element_ty),
             mask=m)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool,
         out: torch.dtype) -> torch.Tensor:
    """Rotate x (B, heads, T, hd) by the tables (B or 1, 1, T, hd), in fp32, into ``out``;
    ``inverse``: by -angle."""
    B, heads, T, hd = x.shape
    assert x.stride(-1) == 1 and hd % 2 == 0, (x.shape, x.stride())
    cos, sin = cos.expand(B, 1, T, hd), sin.expand(B, 1, T, hd)  # stride 0 where broadcast
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1, (cos.stride(), sin.stride())
    y = torch.empty_like(x, dtype=out)  # the same strides as x (dense, non-overlapping views)
    if x.numel():
        half = hd // 2
        _rope[(B * T,)](x, y, cos, sin, T, heads, *_bht(x), *_bht(y), cos.stride(0), cos.stride(2),
                        HALF=half, BLOCK_H=triton.next_power_of_2(heads),
                        BLOCK_D=triton.next_power_of_2(half), INVERSE=inverse, num_warps=4)
        count_launch("rope_bwd" if inverse else "rope_fwd")
    return y


def _bht(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of (batch, head, position)."""
    return t.stride(0), t.stride(1), t.stride(2)


class RoPE(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin for tables from ``rope_tables``, in ``out``; see the module
    docstring. The tables get no gradient (they come from integer positions)."""

    @staticmethod
    def forward(ctx, x, cos, sin, out: torch.dtype):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return rope(x, cos, sin, inverse=False, out=out)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        return rope(dy, cos, sin, inverse=True, out=ctx.x_dtype), None, None, None
