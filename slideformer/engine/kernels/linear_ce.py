"""Chunked linear + cross-entropy: the LM head's loss without materialising full logits.

Maths, for hidden states h_t (H,), head W (V, H), labels y_t (-100 = not trained), scale s:

    z_t = W h_t                          (V,)   logits, computed one chunk of tokens at a time
    L   = s * sum_{t: y_t != -100} (logsumexp(z_t) - z_t[y_t])
    dL/dz_t = s * (softmax(z_t) - onehot(y_t))   for trained t, 0 otherwise
    dL/dh_t = W^T dL/dz_t ;   dL/dW = sum_t dL/dz_t h_t^T

With soft-capping (``softcap`` c: Gemma 4's ``final_logit_softcapping``) the loss reads the
capped logits s_t = c * tanh(z_t / c) in z_t's place (computed in the compute dtype, as
transformers rounds them), and by the chain rule

    dL/dz_t = dL/ds_t * (1 - tanh^2(z_t / c))

The gradients are computed in the forward pass chunk by chunk (logits of one chunk live at a
time, upcast to fp32 for the softmax) and scaled by the incoming gradient in backward, so
peak memory is one chunk of logits, not (tokens x vocab).

On CUDA the softmax part runs as one Triton kernel (``triton_ce``) that writes dL/dz over the
compute-dtype logits, without fp32 copies of them (soft-capped: over s, beside one
compute-dtype copy of tanh(z / c) for the chain rule); the PyTorch code here is its reference
and the path on CPU, without triton, or with ``SLIDEFORMER_TRITON=0`` in the environment.
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


def _logits(h: torch.Tensor, w: torch.Tensor, softcap: float | None):
    """(the logits (n, V) of one chunk in h's dtype, soft-capped when ``softcap`` is given;
    tanh(z / softcap) then, else None), rounded in h's dtype step by step as transformers'
    ``logits / cap``, ``tanh``, ``* cap`` round."""
    z = h @ w.t()  # (n, V)
    if softcap is None:
        return z, None
    t = z.div_(softcap).tanh_()  # z is ours: in place
    return t * softcap, t


def _chunk_grads(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
                 scale: float | torch.Tensor, use_triton: bool | None = None,
                 softcap: float | None = None):
    """Loss sum and dL/dz (fp32 maths, returned in h's dtype) for one chunk (n, H); ``scale``
    is one factor, or one per token (n,) fp32 (a preference objective's sequence weights);
    ``softcap``: the logits' soft cap (module docstring), or None."""
    if _use_triton(h, use_triton):
        z, t = _logits(h, w, softcap)  # (n, V) in h's dtype; the kernel overwrites z with dL/dz
        if isinstance(scale, torch.Tensor):
            loss = _triton_ce().ce_grad_rows_(z, y, 1.0).sum()
            z.mul_(scale[:, None].to(z.dtype))
        else:
            loss = _triton_ce().ce_grad_rows_(z, y, scale).sum()
        if t is not None:  # dL/dz = dL/ds * (1 - t^2), t's buffer reused
            z.mul_(t.square_().neg_().add_(1.0))
        return loss, z
    return _chunk_grads_torch(h, w, y, scale, softcap)


def _chunk_grads_torch(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, scale: float,
                       softcap: float | None = None):
    """_chunk_grads in PyTorch ops: the reference, and the path on CPU."""
    z, t = _logits(h, w, softcap)
    z = z.float()  # (n, V)
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    valid = y != IGNORE
    yc = y.clamp(min=0)
    loss = ((lse - z.gather(1, yc[:, None])[:, 0]) * valid).sum()
    dz = (z - lse[:, None]).exp_()  # softmax
    dz[torch.arange(len(yc), device=dz.device), yc] -= 1.0
    dz *= (valid.float() * scale)[:, None]
    if t is not None:
        dz *= 1.0 - t.float().square()
    return loss, dz.to(h.dtype)


def linear_ce_fwd_bwd(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                      scale: float | torch.Tensor, chunk: int, gw_out: torch.Tensor | None,
                      use_triton: bool | None = None, softcap: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and gradients in one pass over token chunks.

    Args:
        h: hidden states (..., H); w: head (V, H); labels: (...) with -100 = not trained.
        scale: the loss is ``scale`` times the summed cross-entropy; a tensor shaped like
            ``labels`` weighs each token (the returned loss is then the unweighted sum).
        gw_out: fp32 (V, H) buffer that dL/dW is ADDED to (gradient accumulation); None: W
            is frozen, dL/dW is not computed.
        use_triton: force the Triton (True) or PyTorch (False) softmax; None picks (see
            ``_use_triton``).
        softcap: the logits are softcap * tanh(z / softcap) (ModelSpec.logit_softcap), or
            None.
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
        lc, dz = _chunk_grads(hc, w, y[s:s + chunk], sc, use_triton, softcap)
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
                   use_triton: bool | None = None, softcap: float | None = None) -> torch.Tensor:
    """Cross-entropy per token (R, T) fp32, 0 where not labelled, chunked, no gradients (a
    preference objective sums it per sequence)."""
    H = h.shape[-1]
    h2, y = h.reshape(-1, H), labels.reshape(-1)
    out = torch.zeros(y.shape, dtype=torch.float32, device=h.device)
    for s in range(0, h2.shape[0], chunk):
        z = _logits(h2[s:s + chunk], w, softcap)[0]
        if _use_triton(h, use_triton):
            out[s:s + chunk] = _triton_ce().ce_loss_rows(z, y[s:s + chunk])
        else:
            out[s:s + chunk] = torch.nn.functional.cross_entropy(
                z.float(), y[s:s + chunk], ignore_index=IGNORE, reduction="none")
    return out.view(labels.shape)


@torch.no_grad()
def linear_ce_loss(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int,
                   use_triton: bool | None = None, softcap: float | None = None) -> torch.Tensor:
    """Summed cross-entropy over labelled tokens, chunked, no gradients (evaluation)."""
    H = h.shape[-1]
    h2, y = h.reshape(-1, H), labels.reshape(-1)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    if _use_triton(h, use_triton):
        for s in range(0, h2.shape[0], chunk):
            z = _logits(h2[s:s + chunk], w, softcap)[0]
            loss += _triton_ce().ce_loss_rows(z, y[s:s + chunk]).sum()
        return loss
    for s in range(0, h2.shape[0], chunk):
        z = _logits(h2[s:s + chunk], w, softcap)[0].float()
        loss += torch.nn.functional.cross_entropy(z, y[s:s + chunk], ignore_index=IGNORE,
                                                  reduction="sum")
    return loss


class LinearCrossEntropy(torch.autograd.Function):
    """Scaled summed cross-entropy of ``h @ w.T`` against ``labels``; see the module docstring."""

    @staticmethod
    def forward(ctx, h, w, labels, scale: float, chunk: int, softcap: float | None = None):
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        loss, gh = linear_ce_fwd_bwd(h, w, labels, scale, chunk, gw, softcap=softcap)
        ctx.save_for_backward(gh, gw)
        ctx.w_dtype = w.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return gh * g, (gw * g).to(ctx.w_dtype), None, None, None, None


def linear_cross_entropy(h, w, labels, scale: float = 1.0, chunk: int = 4096,
                         softcap: float | None = None):
    """Differentiable ``scale * sum CE(h @ w.T, labels)`` over labels != -100 (the logits
    soft-capped by ``softcap`` when given)."""
    return LinearCrossEntropy.apply(h, w, labels, scale, chunk, softcap)


def reference_linear_cross_entropy(h, w, labels, scale: float = 1.0,
                                   softcap: float | None = None):
    """Plain PyTorch reference (materialises the logits, autograd's gradients); for tests."""
    z = h @ w.t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z.float()
    return torch.nn.functional.cross_entropy(
        z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum") * scale
