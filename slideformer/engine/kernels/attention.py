"""Causal self-attention over packed documents: FlexAttention with a document BlockMask on CUDA.

A packed micro-batch holds several documents per row; a token may attend to the earlier tokens
of its own document only. PyTorch's SDPA takes that as a boolean (B, 1, T, T) mask, which rules
out its flash kernel (measured on an H200, Llama-3.2-3B layer, micro-batch 64, seq 1024:
boolean-mask SDPA 10.7 ms forward + backward, FlexAttention with a document BlockMask 3.5 ms,
largest difference 0.0078 in bf16). FlexAttention skips the (128 x 128) blocks that cross
documents or lie above the diagonal and applies the elementwise rule only on the blocks that
straddle a boundary.

:func:`document_mask` builds the mask of one micro-batch once; every layer of that micro-batch
(forward and recompute) reuses it through :func:`attend`, which sends a BlockMask to the compiled
FlexAttention and anything else (a boolean mask, or None for plain causal rows) to SDPA, whose
``is_causal`` path stays on flash. The boolean mask is the reference and the path on the CPU,
where FlexAttention has no backward, without a usable FlexAttention, and with
``SLIDEFORMER_FLEX=0`` in the environment.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from slideformer.engine.kernels.dispatch import count_launch

ENV = "SLIDEFORMER_FLEX"
"""``SLIDEFORMER_FLEX=0`` keeps packed documents on the boolean-mask SDPA (the reference)."""


FLASH_HEAD_DIM = 256
"""The largest head size PyTorch's fused SDPA kernels (flash, memory-efficient) take on CUDA;
attention of wider heads (Gemma 4's full layers, 512) runs on SDPA's math path, which forms
the scores in memory (plan.speed.SCORE_S, plan.transients.math_scores)."""


def packed_causal_mask(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Block-diagonal causal mask (B, 1, T, T) from per-token document ids (B, T); with a
    ``window``, a query also sees only itself and the ``window - 1`` keys before it."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    if window is not None:
        causal = causal.triu(-(window - 1))
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal)[:, None]


@functools.cache
def _flex_module():
    """torch.nn.attention.flex_attention, or None where this PyTorch has none."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


FLEX_RECOMPILE_LIMIT = 64
"""Compiles of flex_attention one process may make before dynamo falls back to eager."""


@functools.cache
def _flex():
    """The compiled flex_attention.

    Compiled once per process, on first use (torch.compile's import alone costs seconds, which
    the planner, asking only :func:`flex_available`, does not pay): uncompiled, FlexAttention
    materialises the scores (its reference path). Shapes that change between calls recompile
    once, then run dynamic; the grad mode (the forward without autograd, the recompute with it)
    and head shapes add compiles too. Past dynamo's recompile limit (8 by default) the call falls
    back to that uncompiled path without an error: in the whole GPU test suite, which compiles
    it for many shapes in one process, a Qwen3 layer then needed 456 MiB instead of 96. The
    limit is raised so that one process keeps the fused kernel (each compile still costs time,
    not memory).
    """
    import torch._dynamo
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the older PyTorch name, the newer
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), FLEX_RECOMPILE_LIMIT))
    return torch.compile(_flex_module().flex_attention)



def flex_available(device: torch.device | str, head_dim: int) -> bool:
    """Whether packed documents on ``device`` take FlexAttention (the executor's masks, the
    planner through slideformer.engine.kernels.dispatch.kernel_path, the tests).

    Its Triton kernels want a power-of-two head dimension from 16 to :func:`flex_max_head_dim`;
    other models keep the boolean mask."""
    return (torch.device(device).type == "cuda" and os.environ.get(ENV) != "0"
            and 16 <= head_dim <= flex_max_head_dim(device) and head_dim & (head_dim - 1) == 0
            and _flex_module() is not None)


def flex_max_head_dim(device: torch.device | str) -> int:
    """The largest head FlexAttention's kernels fit in a GPU's shared memory: 256 on GPUs with
    about 227 KiB a block (A100, H100, H200, B200), 128 on those with about 100 KiB (consumer
    and workstation cards: RTX 30xx-50xx, L4, L40). Heads of 512 (Gemma 4's full attention)
    asked 257 KiB in FlexAttention's forward on an H100 with torch 2.11 (measured 2026-12-07);
    heads above 128 are reported to fail its backward on ~100 KiB cards. Without a GPU to ask
    (the planner on another machine), 256."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return 256
    props = torch.cuda.get_device_properties(dev)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    return 256 if not smem or smem >= 160 * 1024 else 128


def document_mask(doc_ids: torch.Tensor, head_dim: int, window: int | None = None):
    """The attention mask of a packed (or windowed) micro-batch with document ids (B, T): a
    FlexAttention BlockMask where :func:`flex_available`, else :func:`packed_causal_mask`."""
    if flex_available(doc_ids.device, head_dim):
        return document_block_mask(doc_ids, window)
    return packed_causal_mask(doc_ids, window)


def document_block_mask(doc_ids: torch.Tensor, window: int | None = None):
    """:func:`packed_causal_mask` as a FlexAttention BlockMask (on any device, for the tests).

    Evaluates the rule on every (query, key) pair once, like the boolean mask, but keeps only
    the block table: (B, 1, T/128, T/128) indices instead of (B, 1, T, T) booleans."""
    B, T = doc_ids.shape
    docs = doc_ids.contiguous()

    def same_document_causal(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    def windowed(b, h, q, kv):
        return same_document_causal(b, h, q, kv) & (q - kv < window)
    rule = same_document_causal if window is None else windowed
    return _flex_module().create_block_mask(rule, B, None, T, T, device=doc_ids.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, causal: bool,
           gqa: bool, scale: float | None = None, sinks: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Attention of q (B, nh, T, hd) over k, v (B, nkv, S, hd) -> (B, nh, T, hd).

    Args:
        mask: a BlockMask from :func:`document_mask`, a boolean mask (True = may attend), or
            None (then ``causal`` says whether the rows are causal).
        gqa: nkv < nh (grouped-query attention).
        scale: of the scores; None: 1/sqrt(hd).
        sinks: (nh,) a sink logit per head (GPT-OSS), or None: :func:`attend_with_sinks`.
    """
    if sinks is not None:
        return attend_with_sinks(q, k, v, mask, causal, gqa, scale, sinks)
    if isinstance(mask, torch.Tensor) and q.shape[2] == 1 and gqa:
        return decode_attention(q, k, v, mask, scale)
    if mask is None or isinstance(mask, torch.Tensor):
        if q.is_cuda and q.shape[-1] > FLASH_HEAD_DIM and q.dtype in (torch.bfloat16,
                                                                     torch.float16):
            return wide_attention(q, k, v, mask, causal, gqa, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=gqa, scale=scale)
    return _flex_attend(q, k, v, mask, gqa, scale)


@contextlib.contextmanager
def tf32_matmuls():
    """CUDA's fp32 matmuls on TF32 tensor cores for the duration (the global flag, restored):
    ``allow_tf32``, or ``fp32_precision`` where the process already uses that newer setting
    (PyTorch refuses to read the older one then)."""
    m = torch.backends.cuda.matmul
    try:
        key, old, new = "allow_tf32", m.allow_tf32, True
    except RuntimeError:
        key, old, new = "fp32_precision", m.fp32_precision, "tf32"
    setattr(m, key, new)
    try:
        yield
    finally:
        setattr(m, key, old)


def wide_attention(q, k, v, mask, causal: bool, gqa: bool, scale):
    """SDPA of 16-bit heads wider than :data:`FLASH_HEAD_DIM` on CUDA (Gemma 4's full layers):
    its math path, which turns q, k, v into fp32 and multiplies them on the SIMT cores (16.7 ms
    of a 48 ms Gemma-4 31B full-layer mixer forward + backward on an H100, 3.1 ms on TF32),
    with those matmuls on TF32 tensor cores instead, forward and backward. A bf16 or fp16
    value is exact in TF32 (10 mantissa bits), and the path scales q and k by sqrt(scale) before
    their product: with Gemma 4's scale of 1 (or any power of four) q k^T and dO v^T are the
    same fp32 products, with another scale the scaled inputs are rounded to 10 bits. The
    probabilities and score gradients (fp32) are rounded to TF32 in their products, finer than
    the bf16 that the flash kernels round them to. The flag is global, so the backward runs
    inside this function's own graph (:class:`_TF32Attention`), under the flag again."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _TF32Attention.apply(q, k, v, mask, causal, gqa, scale)
    with tf32_matmuls():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=gqa, scale=scale)


class _TF32Attention(torch.autograd.Function):
    """The math path's own graph, kept from the forward and differentiated under TF32 once (the
    backward frees it; no second backward, no double backward)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, gqa, scale):
        inner = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad(), tf32_matmuls():
            out = F.scaled_dot_product_attention(*inner, attn_mask=mask, is_causal=causal,
                                                 enable_gqa=gqa, scale=scale)
        ctx.inner = inner, out
        return out.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if not hasattr(ctx, "inner"):
            raise RuntimeError("the wide-head attention's graph was freed by an earlier backward")
        inner, out = ctx.inner
        del ctx.inner
        wanted = [t.requires_grad and n for t, n in zip(inner, ctx.needs_input_grad)]
        with tf32_matmuls():
            got = iter(torch.autograd.grad(out, [t for t, w in zip(inner, wanted) if w], grad))
        return (*(next(got) if w else None for w in wanted), None, None, None, None)


def decode_attention(q, k, v, mask: torch.Tensor, scale) -> torch.Tensor:
    """One new token per row (q (B, nh, 1, hd)) over its cache's keys (B, nkv, S, hd) with a
    boolean mask (broadcastable to (B, 1, 1, S)), grouped query heads without copying K and V:
    SDPA with both a mask and GQA has only its math path, which repeats K and V out to every
    query head (in fp32: about 1 GB a layer for 32 rows of an 8B at 2K positions). Here the
    query heads of a KV head are the rows of one matmul: scores (B, nkv, rep, S) in fp32,
    softmax, rounded to v's dtype, times v, as :func:`scores_attention` computes them."""
    B, nh, _, hd = q.shape
    nkv = k.shape[1]
    qg = q.view(B, nkv, nh // nkv, hd)  # (B, nkv, rep, hd): the group's heads as rows
    s = (qg @ k.transpose(-1, -2)).float() * (scale if scale is not None else hd ** -0.5)
    s = s.masked_fill(~mask.view(mask.shape[0], 1, 1, -1), float("-inf"))
    o = torch.softmax(s, dim=-1).to(v.dtype) @ v  # (B, nkv, rep, hd)
    return o.view(B, nh, 1, hd)


def attend_with_sinks(q, k, v, mask, causal: bool, gqa: bool, scale, sinks: torch.Tensor):
    """:func:`attend` with one more logit per head in every softmax, the sink s_h, whose value
    is zero (GPT-OSS). With Z = sum_j exp(score_j) over the keys a query sees and o the plain
    attention output sum_j exp(score_j) v_j / Z:

        out = sum_j exp(score_j) v_j / (Z + exp(s_h)) = o * Z / (Z + exp(s_h))
            = o * sigmoid(lse - s_h),   lse = log Z,

    so any attention that returns its log-sum-exp computes it, and autograd takes the sink's
    gradient and the lse's through the sigmoid. On CUDA that is FlexAttention (its lse is
    differentiable; plain causal rows get a causal BlockMask); elsewhere, and for the few rows
    of a KV-cache step, :func:`scores_attention` forms the scores (the reference)."""
    T, S = q.shape[2], k.shape[2]
    if mask is None and causal and flex_available(q.device, q.shape[-1]):
        mask = causal_block_mask(T, S, q.device)
    if mask is None or isinstance(mask, torch.Tensor):
        o, lse = scores_attention(q, k, v, mask, causal, scale)
    else:
        o, lse = _flex_attend(q, k, v, mask, gqa, scale, return_lse=True)
    keep = torch.sigmoid(lse.float() - sinks.float()[None, :, None])  # (B, nh, T)
    return (o.float() * keep[..., None]).to(o.dtype)


def scores_attention(q, k, v, mask, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, nh, T, hd), log-sum-exp of the scores (B, nh, T) in fp32), the scores
    formed in full: the reference of the attention paths, and their path where no kernel
    returns the lse. ``mask``: boolean (True = may attend) or None; ``causal`` with None."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, nh, S, hd)
    s = (q @ k.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is None and causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, nh, T)
    return (torch.exp(s - lse[..., None]).to(v.dtype) @ v), lse


@functools.lru_cache(maxsize=16)
def causal_block_mask(T: int, S: int, device):
    """The plain causal rule (query i sees keys 0..i) as a BlockMask for all rows."""
    return _flex_module().create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, S,
                                            device=device)


def _flex_attend(q, k, v, mask, gqa: bool, scale, **kw):
    """FlexAttention with the BlockMask ``mask``, compiled (:func:`_flex`); ``kw``: e.g.
    ``return_lse``."""
    count_launch("flex_attention")  # only document_mask makes anything else: a BlockMask
    flag, errors = _limit_flag()
    try:
        with torch._dynamo.config.patch(**{flag: True}):
            return _flex()(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale, **kw)
    except errors as e:
        # dynamo alone would fall back silently; this path is the same, but said once
        if not _FALLBACK["seen"]:
            _FALLBACK.update(seen=True, notice=(
                f"FlexAttention ran uncompiled past dynamo's recompile limit ({type(e).__name__}): "
                "it materialises the attention scores of every micro-batch, slower and with more "
                "GPU memory than planned (this process compiled it for more than "
                f"{FLEX_RECOMPILE_LIMIT} shapes)"))
        return _flex_module().flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa,
                                             scale=scale, **kw)


_FALLBACK = {"seen": False, "notice": None}
"""Whether a call ran uncompiled in this process, and the notice not yet taken."""


@functools.cache
def _limit_flag() -> tuple[str, tuple[type, ...]]:
    """The dynamo setting that turns its silent recompile-limit fallback into an exception,
    and that exception's types (the names moved between PyTorch releases)."""
    import torch._dynamo.exc as exc
    flag = ("fail_on_recompile_limit_hit" if hasattr(torch._dynamo.config, "recompile_limit")
            else "fail_on_cache_limit_hit")
    errors = tuple(t for t in (getattr(exc, "FailOnRecompileLimitHit", None),
                               getattr(exc, "FailOnCacheLimitHit", None)) if t is not None)
    return flag, errors


def take_flex_fallback() -> str | None:
    """The one-time notice that FlexAttention fell back to its uncompiled path in this
    process, or None (the trainer shows it as a warning)."""
    notice, _FALLBACK["notice"] = _FALLBACK["notice"], None
    return notice
