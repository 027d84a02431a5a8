"""Gated DeltaNet, Qwen3.5's "linear_attention" token mixer, on flat parameter views.

Yang et al. 2024, "Gated Delta Networks": a recurrence over a (d_k x d_v) memory per value
head, S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T, o_t = S_t^T q_t,
after a depthwise causal convolution of q, k, v and before a gated RMSNorm and the output
projection (:func:`gated_deltanet`). The layer around it (norms scaling by 1 + w, the MLP or
the experts), the family's gated full-attention layers and the shared expert of Qwen3.5-MoE
are the shared blocks of models.layers and models.moe (families/qwen3_5.py).

On the CPU (and in fp32) a chunked PyTorch form; the token-by-token recurrence is its test
oracle and the decode step; on CUDA in 16-bit, flash-linear-attention's kernels when ``fla``
is installed (kernels.deltanet_gpu).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slideformer.engine.kernels.deltanet_gpu import fla_gated_delta_rule, fla_usable
from slideformer.engine.models.families.base import DeltaNetShape

CHUNK = 64
"""Tokens per chunk of :func:`chunked_rule` (transformers' and fla's size)."""
L2_EPS = 1e-6
"""Of the l2 norm of q and k: x / sqrt(sum x^2 + eps), as fla and transformers compute it."""


def _layers():
    """models.layers, imported at first use: it imports this module (its linear mixer), so
    neither may import the other's names while loading."""
    from slideformer.engine.models import layers
    return layers


def zero_state(cfg: DeltaNetShape, batch: int, dtype: torch.dtype, device) -> tuple:
    """The state before a sequence's first token: (conv inputs (B, conv_dim, kernel - 1) in
    ``dtype``, recurrent state (B, num_v_heads, head_k_dim, head_v_dim) in fp32)."""
    return (torch.zeros(batch, cfg.conv_dim, cfg.conv_kernel - 1, dtype=dtype, device=device),
            torch.zeros(batch, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, device=device))


# ---- the gated delta rule -----------------------------------------------------------------------
def document_starts(doc_ids: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) bool, True where a token's document differs from the previous token's (the state
    resets there); the first token of a row is no start: a given state carries into it."""
    if doc_ids is None:
        return None
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def _segments(starts: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """(B, T) document index of each token in its row, from 0 (all 0 without ``starts``)."""
    if starts is None:
        return torch.zeros(B, T, dtype=torch.long, device=device)
    return starts.long().cumsum(1)


def prepare(q, k, v, g, beta):
    """The rule's inputs (B, T, heads, d) as the references take them: fp32, heads first
    (B, H, T, d), key heads repeated to the value heads, q and k l2-normed, q scaled by
    dk^-1/2; g, beta (B, H, T)."""
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
    return q, k, v, g, beta


def recurrent_rule(q, k, v, g, beta, s0, starts=None):
    """The gated delta rule token by token (the oracle, and the one-token decode step):

        S_t = a_t S_{t-1} + k_t d_t^T,  d_t = beta_t (v_t - a_t S_{t-1}^T k_t),  o_t = S_t^T q_t

    with a_t = exp(g_t), and a_t = 0 where a document starts (``starts``: the state resets).
    Inputs from :func:`prepare`; s0 (B, H, dk, dv). Returns (o (B, H, T, dv), S_T)."""
    S, out = s0, []
    for t in range(q.shape[2]):
        a = g[:, :, t].exp()  # (B, H)
        if starts is not None:
            a = a * (~starts[:, t, None]).float()
        S = S * a[..., None, None]
        d = beta[:, :, t, None] * (v[:, :, t] - (S * k[:, :, t, :, None]).sum(-2))  # (B, H, dv)
        S = S + k[:, :, t, :, None] * d[..., None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))  # (B, H, dv)
    return torch.stack(out, 2), S


def chunked_rule(q, k, v, g, beta, s0, starts=None):
    """:func:`recurrent_rule` computed a chunk of C tokens at a time (the reference path).

    In a chunk entered with state S0, with G_t = g_1 + ... + g_t (cumulated from the chunk's
    start), D_tj = exp(G_t - G_j) for j <= t in the same document (else 0) and c_t = exp(G_t)
    where S0's document reaches t (else 0), unrolling the recurrence gives

        S_t = c_t S0 + sum_{j<=t} D_tj k_j d_j^T
        d_t = beta_t (v_t - c_t S0^T k_t - sum_{j<t} D_tj (k_t . k_j) d_j)

    a unit lower-triangular system (I + A) d = beta v - (beta c k) S0, A_tj = beta_t D_tj k_t.k_j
    (j < t): d = U - W S0 with U = (I + A)^-1 beta v, W = (I + A)^-1 (beta c k), solved for all
    chunks at once. Then chunk by chunk: o = (c q) S0 + (D * q k^T) d and the state leaving
    the chunk, S_C = c_C S0 + (D_C. k)^T d. Padding tokens (g = beta = k = 0) change nothing.
    Inputs from :func:`prepare`; returns (o (B, H, T, dv), S_T)."""
    B, H, T, dk = k.shape
    C = min(CHUNK, T)
    pad = -T % C
    seg = _segments(starts, B, T, k.device)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        seg = torch.cat([seg, seg[:, -1:].expand(B, pad)], 1)  # padding joins the last document
    N = (T + pad) // C
    q, k, v = (t.reshape(B, H, N, C, -1) for t in (q, k, v))  # (B, H, N, C, d)
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    seg = seg.view(B, 1, N, C)
    before = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], 2)  # (B, 1, N, 1) S0's document
    G = g.cumsum(-1)  # (B, H, N, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & causal  # (B, 1, N, C, C)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~same, float("-inf")).exp()  # (B,H,N,C,C)
    c = G.exp() * (seg == before)  # (B, H, N, C)
    kb = k * beta[..., None]  # (B, H, N, C, dk)
    A = (kb @ k.transpose(-1, -2)) * D  # strictly lower part used; unit diagonal implied
    U = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, kb * c[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * D  # (B, H, N, C, C)
    qc = q * c[..., None]  # (B, H, N, C, dk)
    kd = (k * D[..., -1, :, None]).transpose(-1, -2)  # (B, H, N, dk, C) decayed to the last token
    S, out = s0, []
    for n in range(N):
        d = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, dv)
        out.append(qc[:, :, n] @ S + qk[:, :, n] @ d)
        S = S * c[:, :, n, -1, None, None] + kd[:, :, n] @ d
    return torch.stack(out, 2).reshape(B, H, N * C, -1)[:, :, :T], S


def gated_delta_rule(q, k, v, g, beta, state=None, starts=None):
    """The gated delta rule of :func:`recurrent_rule`, l2-normed q and k included:
    (o (B, T, Hv, dv) in v's dtype, final state (B, Hv, dk, dv) in fp32, or None when
    ``state`` is None).

    q, k: (B, T, Hk, dk); v: (B, T, Hv, dv); g (log decays, fp32), beta: (B, T, Hv);
    state: the initial (B, Hv, dk, dv) or None (zeros); starts: :func:`document_starts`.
    CUDA 16-bit inputs take fla's kernel where installed (kernels.deltanet_gpu), one token the
    recurrent step, anything else :func:`chunked_rule` in fp32."""
    T = q.shape[1]
    if T > 1 and fla_usable(v):
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return fla_gated_delta_rule(q, k, v, g, beta, state, starts)
    s0 = (torch.zeros(v.shape[0], v.shape[2], q.shape[-1], v.shape[-1], device=v.device)
          if state is None else state.float())
    rule = recurrent_rule if T == 1 else chunked_rule
    o, S = rule(*prepare(q, k, v, g, beta), s0, starts)
    return o.transpose(1, 2).to(v.dtype), (None if state is None else S)


# ---- the gated DeltaNet layer -------------------------------------------------------------------
def causal_conv(x: torch.Tensor, w: torch.Tensor, starts=None, past=None):
    """silu of the causal depthwise convolution of x (B, T, C) by w (C, 1, K):
    y_t = silu(sum_i w_i x_{t-K+1+i}), taps before the row reading ``past`` (B, C, K-1) (zeros
    if None) and taps in an earlier document reading zero. In fp32, rounded once to x's dtype.
    Returns (y (B, T, C), the new past: the last K-1 inputs, zero where of an earlier document
    than the last token's)."""
    B, T, C = x.shape
    K = w.shape[-1]
    if past is None:
        past = x.new_zeros(B, C, K - 1)
    xs = torch.cat([past.transpose(1, 2).to(x.dtype), x], 1)  # (B, K-1+T, C)
    seg = _segments(starts, B, T, x.device)
    segs = torch.cat([seg[:, :1].expand(B, K - 1), seg], 1)  # (B, K-1+T): past is seg 0's
    wf = w.reshape(C, K).float()
    y = 0
    for i in range(K):  # tap i reads the token K-1-i back
        xi = xs[:, i:i + T]  # (B, T, C)
        if starts is not None:
            xi = xi * (segs[:, i:i + T] == seg)[..., None]
        y = y + xi.float() * wf[:, i]
    keep = (segs[:, T:] == seg[:, -1:])[..., None]  # (B, K-1, 1)
    return F.silu(y).to(x.dtype), (xs[:, T:] * keep).transpose(1, 2)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps) * silu(z) over the last dimension; the normalised x
    rounded to x's dtype before w scales it, the gate in fp32 (transformers' rounding)."""
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w * n * F.silu(z.float())).to(x.dtype)


def gated_deltanet(cfg: DeltaNetShape, p: dict, x: torch.Tensor, doc_ids=None, state=None,
                   lora=None):
    """Qwen3.5's "linear_attention" mixer of normed input x (B, T, H) -> (B, T, H); with
    ``state``, (output, new state).

        q, k, v = split(silu(causal_conv(in_proj_qkv x)))    heads of dk, dk, dv
        z = in_proj_z x,   beta = sigmoid(in_proj_b x)
        g = -exp(A_log) softplus(in_proj_a x + dt_bias)       log decay per value head
        o = gated_delta_rule(q, k, v, g, beta)               (q, k l2-normed inside)
        y = out_proj(gated_rms_norm(o, z) per value head)

    Args:
        p: views named as in transformers' layer without ``model.layers.{i}.``: "linear_attn."
            + in_proj_qkv.weight (conv_dim, H), in_proj_z.weight (value_dim, H),
            in_proj_b.weight and in_proj_a.weight (num_v_heads, H), conv1d.weight
            (conv_dim, 1, kernel), dt_bias and A_log (num_v_heads,), norm.weight (head_v_dim,),
            out_proj.weight (H, value_dim).
        doc_ids: (B, T) document ids of packed rows, or None: the convolution and the
            recurrence restart where the id changes.
        state: (conv inputs (B, conv_dim, kernel - 1), recurrent state (B, num_v_heads,
            head_k_dim, head_v_dim)), e.g. :func:`zero_state` before a prompt;
            None in training (no state returned).
        lora: the layer's adapters (models.lora.LoraForward), or None; in_proj_qkv, in_proj_z
            and out_proj (any projection) can carry one.
    """
    B, T, _ = x.shape
    linear = _layers().linear
    starts = document_starts(doc_ids)
    qkv = linear(p, "linear_attn.in_proj_qkv", x, lora)  # (B, T, conv_dim)
    z = linear(p, "linear_attn.in_proj_z", x, lora)  # (B, T, value_dim)
    b = linear(p, "linear_attn.in_proj_b", x, lora)  # (B, T, Hv)
    a = linear(p, "linear_attn.in_proj_a", x, lora)  # (B, T, Hv)
    qkv, conv_state = causal_conv(qkv, p["linear_attn.conv1d.weight"], starts,
                                  None if state is None else state[0])
    q, k, v = qkv.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    q = q.reshape(B, T, cfg.num_k_heads, cfg.head_k_dim)
    k = k.reshape(B, T, cfg.num_k_heads, cfg.head_k_dim)
    v = v.reshape(B, T, cfg.num_v_heads, cfg.head_v_dim)
    beta = torch.sigmoid(b)  # (B, T, Hv)
    g = -p["linear_attn.A_log"].float().exp() * F.softplus(a.float() + p["linear_attn.dt_bias"])
    o, S = gated_delta_rule(q, k, v, g, beta, None if state is None else state[1], starts)
    o = gated_rms_norm(o, z.view(B, T, cfg.num_v_heads, cfg.head_v_dim),
                       p["linear_attn.norm.weight"], cfg.eps)  # (B, T, Hv, dv)
    y = linear(p, "linear_attn.out_proj", o.reshape(B, T, cfg.value_dim), lora)  # (B, T, H)
    return y if state is None else (y, (conv_state, S))
