"""Chunked linear + cross-entropy: the LM head's loss without materialising full logits.

Maths, for hidden states h_t (H,), head W (V, H), labels y_t (-100 = not trained), scale s:

    z_t = W h_t                          (V,)   logits, computed one chunk of tokens at a time
    L   = s * sum_{t: y_t != -100} (logsumexp(z_t) - z_t[y_t])
    dL/dz_t = s * (softmax(z_t) - onehot(y_t))   for trained t, 0 otherwise
    dL/dh_t = W^T dL/dz_t ;   dL/dW = sum_t dL/dz_t h_t^T

The gradients are computed in the forward pass chunk by chunk (logits of one chunk live at a
time, upcast to fp32 for the softmax) and scaled by the incoming gradient in backward, so
peak memory is one chunk of logits, not (tokens x vocab).

On CUDA the softmax part runs as one Triton kernel (``triton_ce``) that writes dL/dz over the
compute-dtype logits, without fp32 copies of them; the PyTorch code here is its reference and
the path on CPU, without triton, or with ``SLIDEFORMER_TRITON=0`` in the environment.
"""
from __future__ import annotations

import functools
import os

import torch

from slideformer.engine.kernels import IGNORE, dispatch


@functools.cache
def _triton_ce():
    """The Triton module, or None where triton is not installed (CPU installs, CI)."""
    try:
        from slideformer.engine.kernels import triton_ce
    except ImportError:
        return None
    return triton_ce


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """None: Triton for CUDA tensors when available and not disabled by SLIDEFORMER_TRITON=0."""
    if use_triton is None:
        enabled = os.environ.get("SLIDEFORMER_TRITON") != "0"
        return x.is_cuda and enabled and _triton_ce() is not None
    if use_triton and _triton_ce() is None:
        raise RuntimeError("use_triton=True but triton is not installed; `pip install triton` "
                           "(CUDA builds of PyTorch ship it) or leave use_triton unset")
    return use_triton


def _chunk_grads(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                 scale: float | torch.Tensor, use_triton: bool | None = None):
    """Loss sum and dL/dz (fp32 maths, returned in h's dtype) for one chunk (n, H); ``scale``
    is one factor, or one per token (n,) fp32 (a preference objective's sequence weights)."""
    if _use_triton(h, use_triton):
        z = h @ w.t()  # (n, V) in h's dtype; the kernel overwrites it with dL/dz
        if isinstance(scale, torch.Tensor):
            loss = _triton_ce().ce_grad_rows_(z, y, 1.0).sum()
            return loss, z.mul_(scale[:, None].to(z.dtype))
        return _triton_ce().ce_grad_rows_(z, y, scale).sum(), z
    return _chunk_grads_torch(h, w, y, scale)


def _chunk_grads_torch(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, scale: float):
    """_chunk_grads in PyTorch ops: the reference, and the path on CPU."""
    z = (h @ w.t()).float()  # (n, V)
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    valid = y != IGNORE
    yc = y.clamp(min=0)
    loss = ((lse - z.gather(1, yc[:, None])[:, 0]) * valid).sum()
    dz = (z - lse[:, None]).exp_()  # softmax
    dz[torch.arange(len(yc), device=dz.device), yc] -= 1.0
    dz *= (valid.float() * scale)[:, None]
    return loss, dz.to(h.dtype)


def linear_ce_fwd_bwd(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                      scale: float | torch.Tensor, chunk: int, gw_out: torch.Tensor | None,
                      use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and gradients in one pass over token chunks.

    Args:
        h: hidden states (..., H); w: head (V, H); labels: (...) with -100 = not trained.
        scale: the loss is ``scale`` times the summed cross-entropy; a tensor shaped like
            ``labels`` weighs each token (the returned loss is then the unweighted sum).
        gw_out: fp32 (V, H) buffer that dL/dW is ADDED to (gradient accumulation); None: W
            is frozen, dL/dW is not computed.
        use_triton: force the Triton (True) or PyTorch (False) softmax; None picks (see
            ``_use_triton``).
    Returns:
        (scaled loss as a 0-d fp32 tensor, dL/dh shaped like h).
    """
    H = h.shape[-1]
    h2, y = h.reshape(-1, H), labels.reshape(-1)  # (N, H), (N,)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    gh = torch.zeros_like(h2)
    weights = scale.reshape(-1) if isinstance(scale, torch.Tensor) else None
    for s in range(0, h2.shape[0], chunk):
        hc = h2[s:s + chunk]
        sc = scale if weights is None else weights[s:s + chunk]
        lc, dz = _chunk_grads(hc, w, y[s:s + chunk], sc, use_triton)
        loss += lc
        gh[s:s + chunk] = dz @ w
        if gw_out is not None:
            _add_outer(gw_out, dz, hc)
    return (loss if weights is not None else loss * scale), gh.view(h.shape)


# Rows of dL/dW accumulated per block: one (V, H) product in the compute dtype and its fp32
# copy were the largest transient of the step (2.4 GB for a 128k vocabulary at H = 3072).
GW_ROWS = 8192


def _add_outer(gw_out: torch.Tensor, dz: torch.Tensor, hc: torch.Tensor) -> None:
    """gw_out (V, H) fp32 += dz^T (V, n) @ hc (n, H).

    On CUDA in one matmul with an fp32 output (dispatch.fp32_accumulate): no transient, and the
    chunk's product is not rounded to the compute dtype before the sum (on the H200, 2.6 ms
    instead of 4.6 for 2,048 tokens of a 128k x 3072 head: benchmarks/RESULTS.md, 2026-12-02
    second session). Elsewhere a block of vocabulary rows at a time in the compute dtype."""
    if gw_out.is_cuda and dz.dtype != torch.float32 and dispatch.fp32_accumulate("cuda"):
        dispatch.add_product_(gw_out, dz.t(), hc)
        return
    for r in range(0, gw_out.shape[0], GW_ROWS):
        gw_out[r:r + GW_ROWS] += (dz[:, r:r + GW_ROWS].t() @ hc).float()


@torch.no_grad()
def linear_ce_rows(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int,
                   use_triton: bool | None = None) -> torch.Tensor:
    """Cross-entropy per token (R, T) fp32, 0 where not labelled, chunked, no gradients (a
    preference objective sums it per sequence)."""
    H = h.shape[-1]
    h2, y = h.reshape(-1, H), labels.reshape(-1)
    out = torch.zeros(y.shape, dtype=torch.float32, device=h.device)
    for s in range(0, h2.shape[0], chunk):
        z = h2[s:s + chunk] @ w.t()
        if _use_triton(h, use_triton):
            out[s:s + chunk] = _triton_ce().ce_loss_rows(z, y[s:s + chunk])
        else:
            out[s:s + chunk] = torch.nn.functional.cross_entropy(
                z.float(), y[s:s + chunk], ignore_index=IGNORE, reduction="none")
    return out.view(labels.shape)


@torch.no_grad()
def linear_ce_loss(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int,
                   use_triton: bool | None = None) -> torch.Tensor:
    """Summed cross-entropy over labelled tokens, chunked, no gradients (evaluation)."""
    H = h.shape[-1]
    h2, y = h.reshape(-1, H), labels.reshape(-1)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    if _use_triton(h, use_triton):
        for s in range(0, h2.shape[0], chunk):
            loss += _triton_ce().ce_loss_rows(h2[s:s + chunk] @ w.t(), y[s:s + chunk]).sum()
        return loss
    for s in range(0, h2.shape[0], chunk):
        z = (h2[s:s + chunk] @ w.t()).float()
        loss += torch.nn.functional.cross_entropy(z, y[s:s + chunk], ignore_index=IGNORE,
                                                  reduction="sum")
    return loss


class LinearCrossEntropy(torch.autograd.Function):
    """Scaled summed cross-entropy of ``h @ w.T`` against ``labels``; see the module docstring."""

    @staticmethod
    def forward(ctx, h, w, labels, scale: float, chunk: int):
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        loss, gh = linear_ce_fwd_bwd(h, w, labels, scale, chunk, gw)
        ctx.save_for_backward(gh, gw)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return gh * g, (gw * g).to(ctx.w_dtype), None, None, None


def linear_cross_entropy(h, w, labels, scale: float = 1.0, chunk: int = 4096):
    """Differentiable ``scale * sum CE(h @ w.T, labels)`` over labels != -100."""
    return LinearCrossEntropy.apply(h, w, labels, scale, chunk)


def reference_linear_cross_entropy(h, w, labels, scale: float = 1.0):
    """Plain PyTorch reference (materialises the logits); for tests."""
    z = (h @ w.t()).float()
    return torch.nn.functional.cross_entropy(
        z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum") * scale
