"""A mixture-of-experts feed-forward on flat parameter views: router, routed experts, combine.

For N tokens, E experts and top-k routing (Shazeer et al. 2017; Mixtral, Qwen3-MoE):

    probs = softmax(x Wr^T)               (N, E), in fp32
    w, e  = topk(probs, k)                (N, k): each token's experts and their weights
    w     = w / sum(w)                    when the family renormalises
    y[n]  = sum_j w[n, j] * down_e(act(gate_e(x[n])) * up_e(x[n])),  e = e[n, j]

The N*k (token, expert) pairs are sorted by expert, so each expert's tokens are one contiguous
block; the three projections are then grouped matmuls over those blocks (``F.grouped_mm`` on
CUDA in 16-bit: one kernel per projection, no loop over experts), a loop over the blocks on the
CPU (the reference path). Gradients are autograd's through these ops, routing weights included
(the expert choice itself is piecewise constant and has none, as in transformers).

GPT-OSS (``Moe.gpt_oss``) routes by the top-k logits of a router with a bias, softmaxed over
those k, and its experts add biases, interleave gate and up in one projection stored (E, in,
out), and gate with :func:`clamped_swiglu`.

Gemma 4 (``Moe.gemma4``) routes by its own input (``route_in``: the residual stream normed and
scaled, models.layers.experts_beside), multiplies the renormalised weights by a learnt scale
per expert, w[n, j] *= s[e[n, j]], and holds gate and up in one (E, 2I, H) projection, gate
its first I outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slideformer.engine.kernels.dispatch import count_launch


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
"""torch's grouped matmul: ``F.grouped_mm`` in recent releases, ``torch._grouped_mm`` before
(the same operator), None where this torch has neither."""


def _grouped_kernel(x: torch.Tensor) -> bool:
    """Whether x's expert blocks go through one grouped-matmul kernel (CUDA, 16-bit)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _GROUPED_MM is not None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                   ends: torch.Tensor | None, in_out: bool = False) -> torch.Tensor:
    """Block b of x (rows by ``counts``, expert order) times expert b's matrix: (M, in) ->
    (M, out).

    ``w``: stacked experts, (E, out, in), or (E, in, out) when ``in_out`` (GPT-OSS).
    ``ends``: int32 cumulative counts (the grouped kernel's offsets), or None on the reference
    path."""
    wt = w if in_out else w.transpose(-2, -1)  # (E, in, out)
    if ends is not None:
        count_launch("grouped_mm")
        # the kernel takes operands at 16-byte aligned addresses only; a layer's flat buffer
        # places a stacked tensor wherever the tensors before it end (tiny models: anywhere),
        # so such a view is copied (clone keeps its strides), an aligned one used in place
        return _GROUPED_MM(_aligned(x), _aligned(wt), offs=ends)
    blocks = torch.split(x, counts.tolist())
    return torch.cat([xb @ wt[e] for e, xb in enumerate(blocks)])


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % 16 == 0 else t.clone()


def route(logits: torch.Tensor, top_k: int, renormalise: bool, top_first: bool = False):
    """(weights (N, k) in fp32, expert ids (N, k)) from router logits (N, E): softmax, then
    the top k (renormalised when asked); ``top_first``: the top-k logits, then their softmax
    (GPT-OSS)."""
    if top_first:
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated activation: (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g'),
    g' = min(g, limit)."""
    g = g.clamp(max=limit)
    return (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))


class RouterAux:
    """The router's load-balancing loss of one micro-batch (Switch Transformer, Fedus et al.
    2021, eq. 4-6), as transformers' ``load_balancing_loss_func`` computes it from every
    layer's router logits when ``output_router_logits`` is on: over the L layers and N tokens,

        f_e = (assignments of a token's top-k slots to e) / (L N),   P_e = mean_{l,n} p_{l,n,e}
        aux = E * sum_e f_e P_e,   p = softmax(logits) over all E experts

    The choice (f) has no gradient. The forward, without autograd, records each layer's counts
    and probabilities (:meth:`observe` with grad off); f is then fixed, and the backward's
    recompute of layer l adds ``weight * E / (L N) * sum_{n,e} f_e p_{l,n,e}``, whose gradient
    w.r.t. that layer's logits is aux's (:meth:`observe` with grad on; :meth:`take`).
    ``weight``: what the step's loss multiplies this micro-batch's aux by."""

    def __init__(self, experts: int, layers: int, tokens: int, weight: float, device):
        self.E, self.rows, self.weight = experts, layers * tokens, weight
        self.counts = torch.zeros(experts, dtype=torch.float32, device=device)
        self.probs = torch.zeros(experts, dtype=torch.float32, device=device)
        self.terms: list[torch.Tensor] = []

    def observe(self, logits: torch.Tensor, ids: torch.Tensor) -> None:
        p = torch.softmax(logits.float(), dim=-1)  # (N, E)
        if not torch.is_grad_enabled():  # the forward: counts and probabilities
            self.counts += torch.bincount(ids.reshape(-1), minlength=self.E).float()
            self.probs += p.sum(0)
            return
        f = self.counts / self.rows  # (E,), fixed
        self.terms.append((p * f).sum() * (self.weight * self.E / self.rows))

    def value(self) -> float:
        """weight * aux of the forward's logits."""
        return float(self.weight * self.E * (self.counts / self.rows * self.probs / self.rows).sum())

    def take(self) -> list[torch.Tensor]:
        """The terms the recompute of one layer added (their gradient is the loss's)."""
        out, self.terms = self.terms, []
        return out


def moe_ffn(spec, p: dict, h: torch.Tensor, act, aux: RouterAux | None = None,
            route_in: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output for normed input h (B, T, H) -> (B, T, H); ``act(g, u)`` is the
    family's gated activation (GPT-OSS: :func:`clamped_swiglu`); ``aux``: the micro-batch's
    router loss, when the run computes it; ``route_in``: what the router reads, if not h
    (Gemma 4)."""
    m, s = spec.family.moe, spec.moe
    B, T, H = h.shape
    x = h.reshape(-1, H)  # (N, H)
    r = x if route_in is None else route_in.reshape(-1, H)
    logits = F.linear(r, p[m.router], p[m.router_bias] if m.gpt_oss else None)  # (N, E)
    w, ids = route(logits, s.top_k, s.renormalise, top_first=m.gpt_oss)  # (N, k)
    if m.gemma4:
        w = w * p["router.per_expert_scale"][ids]  # (N, k) fp32
    if aux is not None:
        aux.observe(logits, ids)
    flat = ids.reshape(-1)  # (N*k,) pair j*k + slot
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    counts = torch.bincount(flat, minlength=s.experts)  # (E,)
    ends = counts.cumsum(0).to(torch.int32) if _grouped_kernel(x) else None
    token = order // s.top_k  # (N*k,) the token of each sorted pair
    xs = x[token]  # (N*k, H)
    if m.gpt_oss:
        expert = flat[order]  # (N*k,) the expert of each sorted pair
        gu = grouped_linear(xs, p[m.stacked(m.gate)], counts, ends, in_out=True) \
            + p[m.bias(m.gate)][expert]  # (N*k, 2I): gate, up interleaved
        z = clamped_swiglu(gu[:, 0::2], gu[:, 1::2], s.alpha, s.limit)  # (N*k, I)
        y = grouped_linear(z, p[m.stacked(m.down)], counts, ends, in_out=True) \
            + p[m.bias(m.down)][expert]  # (N*k, H)
    elif m.gemma4:
        z = act(*grouped_linear(xs, p[m.stacked(m.gate)], counts, ends).chunk(2, dim=-1))
        y = grouped_linear(z, p[m.stacked(m.down)], counts, ends)  # (N*k, H)
    else:
        z = act(grouped_linear(xs, p[m.stacked(m.gate)], counts, ends),
                grouped_linear(xs, p[m.stacked(m.up)], counts, ends))  # (N*k, I)
        y = grouped_linear(z, p[m.stacked(m.down)], counts, ends)  # (N*k, H)
    y = (y.float() * w.reshape(-1)[order, None]).to(x.dtype)
    out = x.new_zeros(x.shape).index_add(0, token, y)  # (N, H)
    if m.shared is not None:  # every token's shared expert, gated per token
        sh = F.linear(act(F.linear(x, p[f"{m.shared}.gate_proj.weight"]),
                          F.linear(x, p[f"{m.shared}.up_proj.weight"])),
                      p[f"{m.shared}.down_proj.weight"])  # (N, H)
        out = out + torch.sigmoid(F.linear(x, p[f"{m.shared}_gate.weight"])) * sh
    return out.view(B, T, H)
