"""Qwen3.5's hybrid decoder layers on flat parameter views: gated DeltaNet and gated attention.

Qwen3.5 (``qwen3_5`` / text ``qwen3_5_text``, ``qwen3_5_moe``) marks each layer in
``layer_types``: "linear_attention" (:func:`gated_deltanet`, a gated delta rule recurrence,
Yang et al. 2024, "Gated Delta Networks") or "full_attention" (:func:`gated_attention`,
softmax attention with an output gate). Both sit in a pre-norm layer whose RMSNorms scale by
``1 + w`` (zero-centred weights, layers.rms_norm's ``offset`` 1)::

    h = x + mixer(norm(x)),   y = h + ffn(norm(h))                   (:func:`qwen35_layer`)

The released checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): the text
config sits under "text_config" (``from_config`` reads either), the text layers under
``model.language_model.layers.{i}.``, beside ``model.visual.*`` and ``mtp.*`` (a multi-token
prediction head that transformers drops on load).

The MoE variant (``qwen3_5_moe``, transformers' ``Qwen3_5MoeSparseMoeBlock``) has the same
two mixers; its feed-forward, in every layer (no dense layers), is:

- router ``mlp.gate.weight`` (E, H): softmax over the E = ``num_experts`` logits in fp32, the
  top ``num_experts_per_tok``, always renormalised (no ``norm_topk_prob`` key): Qwen3-MoE's
  routing, so models.moe.moe_ffn with ``renormalise`` True;
- experts of width ``moe_intermediate_size``: transformers 5 holds them fused,
  ``mlp.experts.gate_up_proj`` (E, 2I, H) (gate rows, then up rows) and
  ``mlp.experts.down_proj`` (E, H, I); its checkpoint conversion (qwen2_moe's) also reads
  per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``: check the checkpoint's index;
- a shared expert every token takes, a SwiGLU MLP ``mlp.shared_expert.{gate,up,down}_proj``
  of width ``shared_expert_intermediate_size``, scaled per token by
  sigmoid(``mlp.shared_expert_gate.weight`` (1, H) . h): :func:`shared_expert`;
- output = routed + shared; the router loss (``router_aux_loss_coef``, 0.001) is transformers'
  load_balancing_loss_func over all layers (models.moe.RouterAux's).
transformers' defaults: hidden 2048, 40 layers, 16 heads / 2 KV heads of 256, DeltaNet 16 key /
32 value heads of 128, 256 experts, top 8, widths 512 (routed and shared).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slideformer.engine.kernels.attention import attend
from slideformer.engine.kernels.deltanet_gpu import fla_gated_delta_rule, fla_usable

CHUNK = 64
"""Tokens per chunk of :func:`chunked_rule` (transformers' and fla's size)."""
L2_EPS = 1e-6
"""Of the l2 norm of q and k: x / sqrt(sum x^2 + eps), as fla and transformers compute it."""


def _layers():
    """models.layers, imported at first use: it imports this module (its linear mixer), so
    neither may import the other's names while loading."""
    from slideformer.engine.models import layers
    return layers


def _text(cfg: dict) -> dict:
    """A config.json's text part: its "text_config" (the multimodal checkpoints), else itself."""
    return cfg.get("text_config") or cfg


@dataclass(frozen=True)
class DeltaNetShape:
    """The sizes of a gated DeltaNet layer ("linear_attention")."""

    num_k_heads: int
    """Query and key heads (``linear_num_key_heads``)."""
    num_v_heads: int
    """Value heads (``linear_num_value_heads``), a multiple of the key heads: key head i serves
    value heads i*r .. i*r + r - 1."""
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    """Taps of the causal depthwise convolution (``linear_conv_kernel_dim``)."""
    eps: float
    """Of the gated RMSNorm (``rms_norm_eps``)."""

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v of in_proj_qkv."""
        return 2 * self.key_dim + self.value_dim

    @staticmethod
    def from_config(cfg: dict) -> "DeltaNetShape":
        c = _text(cfg)
        return DeltaNetShape(c["linear_num_key_heads"], c["linear_num_value_heads"],
                             c["linear_key_head_dim"], c["linear_value_head_dim"],
                             c["linear_conv_kernel_dim"], c["rms_norm_eps"])

    def zero_state(self, batch: int, dtype: torch.dtype, device) -> tuple:
        """The state before a sequence's first token: (conv inputs (B, conv_dim, kernel - 1)
        in ``dtype``, recurrent state (B, num_v_heads, head_k_dim, head_v_dim) in fp32)."""
        return (torch.zeros(batch, self.conv_dim, self.conv_kernel - 1, dtype=dtype,
                            device=device),
                torch.zeros(batch, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                            device=device))


@dataclass(frozen=True)
class AttentionShape:
    """The sizes of a gated attention layer ("full_attention")."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    """Leading dimensions of each head that RoPE rotates: int(head_dim * partial_rotary_factor)."""
    rope_theta: float
    eps: float
    """Of the q and k RMSNorms (``rms_norm_eps``)."""

    @staticmethod
    def from_config(cfg: dict) -> "AttentionShape":
        c = _text(cfg)
        rope = c.get("rope_parameters") or {}
        kind = rope.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"Qwen3.5 rope_type {kind!r} in config.json: only 'default' is "
                             "supported (remove the scaling or use the model's own config)")
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        # transformers' default of 0.25 for configs that omit it (Qwen3_5TextConfig)
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        return AttentionShape(c["num_attention_heads"], c["num_key_value_heads"], hd,
                              int(hd * partial), rope.get("rope_theta", c.get("rope_theta")),
                              c["rms_norm_eps"])


@dataclass(frozen=True)
class Qwen35Shape:
    """Both mixers' sizes and the layers' norm epsilon, for :func:`qwen35_layer`."""

    deltanet: DeltaNetShape
    attention: AttentionShape
    eps: float

    @staticmethod
    def from_config(cfg: dict) -> "Qwen35Shape":
        return Qwen35Shape(DeltaNetShape.from_config(cfg), AttentionShape.from_config(cfg),
                           _text(cfg)["rms_norm_eps"])


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
            head_k_dim, head_v_dim)), e.g. :meth:`DeltaNetShape.zero_state` before a prompt;
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


# ---- the gated attention layer ------------------------------------------------------------------
def rotary_tables(cfg: AttentionShape, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin (B, 1, T, rotary_dim) for integer positions (B, T). Text alone gives transformers'
    multimodal RoPE (mrope) the same position in its three sections, which makes it this plain
    RoPE over the rotated dimensions (the tests check it against transformers' tables)."""
    inv = _layers().rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, None).to(positions.device)
    freqs = positions.float()[..., None] * inv  # (B, T, rd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, rd)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def gated_attention(cfg: AttentionShape, p: dict, h: torch.Tensor, rope, mask=None, cache=None,
                    lora=None) -> torch.Tensor:
    """Qwen3.5's "full_attention" mixer of normed input h (B, T, H) -> (B, T, H).

    q_proj gives each head [query | gate] (2 head_dim); q and k get a per-head RMSNorm scaled by
    1 + w, then RoPE on their first rotary_dim dimensions; the attention output is multiplied by
    sigmoid(gate) before o_proj:

        a = attend(rope(norm(q)), rope(norm(k)), v);   y = o_proj(a * sigmoid(gate))

    Args:
        p: "self_attn." + q_proj.weight (2 heads head_dim, H), k_proj.weight and v_proj.weight
            (kv_heads head_dim, H), o_proj.weight (H, heads head_dim), q_norm.weight and
            k_norm.weight (head_dim,).
        rope: (cos, sin) of :func:`rotary_tables`; their dtype is that of the normed q and k
            (fp32 tables rotate fp32 values), as in layers.attention.
        mask, cache: as layers.attention's (None: plainly causal; a boolean or BlockMask of
            packed documents; a KV cache when generating).
        lora: the layer's adapters, or None.
    """
    B, T, _ = h.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    L = _layers()
    linear, rms_norm = L.linear, L.rms_norm
    qg = linear(p, "self_attn.q_proj", h, lora).view(B, T, nh, 2 * hd)
    q, gate = qg.split(hd, dim=-1)  # (B, T, nh, hd) each
    k = linear(p, "self_attn.k_proj", h, lora).view(B, T, nkv, hd)
    v = linear(p, "self_attn.v_proj", h, lora).view(B, T, nkv, hd).transpose(1, 2)
    cos, sin = rope
    q = rms_norm(q, p["self_attn.q_norm.weight"], cfg.eps, cos.dtype, offset=1.0).transpose(1, 2)
    k = rms_norm(k, p["self_attn.k_norm.weight"], cfg.eps, cos.dtype, offset=1.0).transpose(1, 2)
    q, k = L.apply_rope(q, cos, sin, v.dtype), L.apply_rope(k, cos, sin, v.dtype)  # partial
    if cache is not None:
        k, v = cache.extend(k, v)  # (B, nkv, past + T, hd)
    causal = mask is None and k.shape[2] == T and T > 1
    a = attend(q, k, v, mask, causal, nh != nkv)  # (B, nh, T, hd)
    a = a.transpose(1, 2).reshape(B, T, nh * hd) * torch.sigmoid(gate.reshape(B, T, nh * hd))
    return linear(p, "self_attn.o_proj", a, lora)


# ---- feed-forward and the whole layer -----------------------------------------------------------
def mlp(p: dict, prefix: str, h: torch.Tensor, lora=None) -> torch.Tensor:
    """The SwiGLU MLP ``prefix`` ("mlp", "mlp.shared_expert"): down(silu(gate h) * up h)."""
    L = _layers()
    z = L.swiglu(L.linear(p, prefix + ".gate_proj", h, lora),
                 L.linear(p, prefix + ".up_proj", h, lora))
    return L.linear(p, prefix + ".down_proj", z, lora)


def shared_expert(p: dict, h: torch.Tensor, lora=None) -> torch.Tensor:
    """Qwen3.5-MoE's shared expert of normed h (B, T, H), added to the routed experts' output:
    sigmoid(shared_expert_gate h) * mlp.shared_expert(h)."""
    gate = _layers().linear(p, "mlp.shared_expert_gate", h)  # (B, T, 1)
    return torch.sigmoid(gate) * mlp(p, "mlp.shared_expert", h, lora)


def qwen35_layer(cfg: Qwen35Shape, p: dict, x: torch.Tensor, rope=None, mask=None, doc_ids=None,
                 lora=None) -> torch.Tensor:
    """One dense Qwen3.5 decoder layer in training: x (B, T, H) -> (B, T, H), its mixer the
    DeltaNet where ``p`` has "linear_attn.A_log", else gated attention (``rope``, ``mask``).
    ``doc_ids`` packs documents for the DeltaNet (the attention's ``mask`` does for it).
    x may be wider than the weights (an fp32 residual stream): the norms round once to the
    weights' dtype and the residual additions stay in x's."""
    rms_norm = _layers().rms_norm
    c = p["mlp.down_proj.weight"].dtype
    h = rms_norm(x, p["input_layernorm.weight"], cfg.eps, c, offset=1.0)
    if "linear_attn.A_log" in p:
        x = x + gated_deltanet(cfg.deltanet, p, h, doc_ids, lora=lora)
    else:
        x = x + gated_attention(cfg.attention, p, h, rope, mask, lora=lora)
    h = rms_norm(x, p["post_attention_layernorm.weight"], cfg.eps, c, offset=1.0)
    return x + mlp(p, "mlp", h, lora)
