"""Triton cross-entropy over a chunk of logits: loss per row and dL/dz written over the logits.

For logits z (n, V) in the compute dtype, labels y (n,) (-100 = not trained) and scale s, one
program per row t reads the row twice, in blocks of V, with fp32 maths:

    pass 1:  m = max_j z_tj, d = sum_j exp(z_tj - m)   (online: d *= exp(m_old - m_new) per
             block, so large logits never overflow), and the label logit z_t[y_t]
             lse_t  = m + log(d)
             loss_t = lse_t - z_t[y_t]                 (0 for ignored rows)
    pass 2:  z_tj <- s * (exp(z_tj - lse_t) - [j == y_t])   in z's dtype (0 for ignored rows)

This is ``linear_ce._chunk_grads_torch`` without its (n, V) fp32 copies of the logits and
softmax and its ~6 passes over them: the matmul stays in cuBLAS, the rest is 2 reads and 1
write of the compute-dtype logits.

Triton comes with CUDA builds of PyTorch; it is not a dependency of the package. Only
``linear_ce`` imports this module, lazily, and falls back to PyTorch without it. Under
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (numpy), which the tests use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slideformer.engine.kernels import IGNORE as IGNORE_INDEX

IGNORE = tl.constexpr(IGNORE_INDEX)  # a jit kernel reads only constexpr globals
# Upper bound on the block of vocabulary one program holds in registers per step. Untuned
# starting point; benchmarks/linear_ce_bench.py measures the whole head on a GPU.
MAX_BLOCK = 4096


@triton.jit
def _ce_rows_kernel(z_ptr, z_stride, y_ptr, loss_ptr, V, scale,
                    BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: n * V passes 2**31 for long chunks
    z_row = z_ptr + row * z_stride
    y = tl.load(y_ptr + row)
    valid = y != IGNORE
    cols = tl.arange(0, BLOCK)

    m = tl.full((), float("-inf"), tl.float32)
    d = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(d)

    # A label outside [0, V) reads nothing and turns the loss into NaN instead of reading
    # another row's memory (the PyTorch path raises on CPU, device-asserts on CUDA).
    in_range = (y >= 0) & (y < V)
    z_y = tl.load(z_row + tl.where(in_range, y, 0), mask=in_range, other=float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, lse - z_y.to(tl.float32), 0.0))

    if WRITE_GRAD:  # in place: each program reads a block of its own row, then overwrites it
        coef = tl.where(valid, scale, 0.0)
        for start in range(0, V, BLOCK):
            mask = start + cols < V
            x = tl.load(z_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse) - tl.where(start + cols == y, 1.0, 0.0)
            tl.store(z_row + start + cols, (p * coef).to(z_ptr.dtype.element_ty), mask=mask)


def _launch(z: torch.Tensor, y: torch.Tensor, scale: float, write_grad: bool) -> torch.Tensor:
    n, V = z.shape
    assert z.stride(1) == 1 and y.shape == (n,), (z.shape, z.stride(), y.shape)
    loss = torch.empty(n, dtype=torch.float32, device=z.device)  # (n,)
    if n == 0:
        return loss
    block = min(MAX_BLOCK, triton.next_power_of_2(V))
    _ce_rows_kernel[(n,)](z, z.stride(0), y.contiguous(), loss, V, scale,
                          BLOCK=block, WRITE_GRAD=write_grad,
                          num_warps=8 if block >= 2048 else 4)  # untuned, like MAX_BLOCK
    return loss


def ce_grad_rows_(z: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-row loss (n,) fp32 of logits z (n, V); overwrites z with s * (softmax - onehot)."""
    return _launch(z, y, float(scale), True)


def ce_loss_rows(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-row loss (n,) fp32 of logits z (n, V), 0 for ignored rows; z is left as it is."""
    return _launch(z, y, 0.0, False)
