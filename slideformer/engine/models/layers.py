"""Decoder maths on flat parameter views: RMSNorm, RoPE, attention, gated MLP, one decoder layer.

The layer is Llama's with the differences its family declares (models.families): norm
placement, q/k norms, NoPE layers, GeGLU, a mixture of experts (models.moe), Gemma 4's value
norm, keys as values, experts beside the MLP and layer scalar.

The forward only: the backward (a layer recomputed from its input, whole or in tiles) is
models.recompute.

Every function takes the parameter views of :meth:`Layout.views` (a dict keyed by Hugging Face
names without the ``model.layers.{i}.`` prefix), so the same code runs on a GPU slot, a host
buffer or an ``nn.Parameter``. The numerics follow Hugging Face's implementations (norms in
fp32, RoPE tables in fp32 cast to the activation dtype) so logits agree to rounding.

The residual stream ``x`` may be wider than the weights (fp32 under bf16 matmuls, the
``autocast`` precision of slideformer.engine.config.TrainConfig): the layer then computes as
``torch.autocast(bfloat16)`` does on an fp32 model. Norms scale in fp32 and round once for the
matmuls, RoPE rotates in fp32 with fp32 tables and rounds once, and the residual additions stay in
fp32 (forward and backward).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slideformer.engine.kernels import dispatch, fp8
from slideformer.engine.kernels.attention import attend
from slideformer.engine.models.moe import moe_ffn
from slideformer.engine.models.spec import ModelSpec


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
             out: torch.dtype | None = None, offset: float = 0.0,
             fp32: bool = False) -> torch.Tensor:
    """y = (offset + w) * x / sqrt(mean(x^2) + eps), the statistics in fp32.

    ``out``: the dtype y is used in. None, or x's own: Hugging Face's rounding (the normalised
    value rounded to x's dtype, then scaled by w). Another: the scaling in fp32, rounded once to
    ``out`` (an fp32 stream feeding bf16 matmuls, or fp32 q/k ahead of fp32 RoPE).
    ``offset`` 1 is Gemma's norm (weights stored as w - 1), which scales in fp32 and rounds
    once whatever ``out`` is, as transformers' Gemma3RMSNorm does; ``fp32``: so does the norm
    without offset (Gemma 4's). The fused kernel takes every case.
    """
    if dispatch.use_triton(x):
        return dispatch.rms_norm(x, w, eps, out, offset, fp32)
    if offset or fp32:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return ((offset + w.float()) * xf).to(out or x.dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if out is None or out == x.dtype:
        return w * xf.to(x.dtype)
    return (w.float() * xf).to(out)


def norm(spec: ModelSpec, p: dict, name: str, x: torch.Tensor,
         out: torch.dtype | None = None) -> torch.Tensor:
    """The family's RMSNorm ``name`` (e.g. "input_layernorm") of x."""
    return rms_norm(x, p[name + ".weight"], spec.rms_norm_eps, out, spec.family.norm_offset,
                    spec.family.norm_fp32)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in fp32, rounded to x's dtype: an RMSNorm without weight
    (Gemma 4's value norm and router norm); the fused kernel with a unit weight where it runs."""
    if dispatch.use_triton(x):
        return dispatch.rms_norm(x, torch.ones(x.shape[-1], device=x.device), eps, fp32=True)
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling, long: bool = False) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with linear, llama3, YaRN, proportional or
    LongRoPE ``scaling`` (a spec's sorted items, or None) applied; ``long``: LongRoPE's
    ``long_factor`` (else its ``short_factor``)."""
    hd = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if not scaling:
        return inv
    rs = dict(scaling)
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "longrope":
        return inv / torch.tensor(rs["long_factor" if long else "short_factor"])
    if kind == "proportional":
        # Gemma 4's full layers: the first int(p * hd / 2) pairs keep the frequencies of a RoPE
        # over the whole head (not of a RoPE over p * hd dims), the others turn at frequency 0
        # (cos 1, sin 0: unchanged); all divided by ``factor`` (transformers' rule)
        turning = int(float(rs.get("partial_rotary_factor", 1.0)) * hd // 2)
        inv = torch.cat((inv[:turning], torch.zeros(hd // 2 - turning)))
        return inv / float(rs.get("factor", 1.0))
    factor = float(rs["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "yarn":
        return _yarn_inv_freq(inv, hd, theta, factor, rs)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1 model card / reference implementation).
    lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv: torch.Tensor, hd: int, theta: float, factor: float,
                   rs: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): frequencies that
    turn fewer than ``beta_slow`` times over the original context are interpolated (divided
    by ``factor``), those that turn more than ``beta_fast`` times kept, a linear ramp over the
    dimensions between; transformers' ``truncate`` rounds the ramp's ends to whole dimensions."""
    old = float(rs["original_max_position_embeddings"])
    fast, slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        return hd * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, hd - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(scaling) -> float:
    """What YaRN and LongRoPE multiply the cos and sin tables by (1 for other scalings): their
    ``attention_factor``, else 0.1 ln(factor) + 1, or with ``mscale`` and ``mscale_all_dim``
    the ratio of that formula at each (transformers' rule)."""
    rs = dict(scaling or ())
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "longrope":  # set when the config is read (families.base._longrope)
        return float(rs.get("attention_factor", 1.0))
    if kind != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = float(rs["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(float(rs["mscale"])) / mscale(float(rs["mscale_all_dim"]))
    return mscale()


def rope_tables(spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype,
                local: bool = False, head_dim: int | None = None):
    """cos, sin tables (B, 1, T, rotated dims) for integer ``positions`` (B, T); ``local``: of
    the sliding layers' own RoPE (:attr:`ModelSpec.local_rope`); ``head_dim``: of layers of
    that head size (default the model's; Gemma 4's full layers have their own). The rotated
    dimensions are the head's, or the leading :attr:`ModelSpec.rotary_dim` of it (partial
    RoPE)."""
    theta, scaling = spec.local_rope if local else (spec.rope_theta, spec.rope_scaling)
    hd = spec.rotary_dim or head_dim or spec.head_dim
    inv = rope_inv_freq(hd, theta, scaling).to(positions.device)
    rs = dict(scaling or ())
    if rs.get("rope_type") == "longrope":
        # LongRoPE: the long factors for a whole forward whose positions pass the original
        # context (transformers' rule: max position + 1 > original), chosen on the device
        inv = torch.where(positions.max() + 1 > rs["original_max_position_embeddings"],
                          rope_inv_freq(hd, theta, scaling, long=True).to(positions.device), inv)
    freqs = positions.float()[..., None] * inv  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hd)
    f = rope_attention_factor(scaling)
    if f == 1.0:
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    return (emb.cos() * f).to(dtype)[:, None], (emb.sin() * f).to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out: torch.dtype | None = None) -> torch.Tensor:
    """Rotate (B, heads, T, hd) by the tables (B, 1, T, r), in the wider of the two dtypes;
    the result in ``out`` (default: x's dtype). r < hd (partial RoPE): the first r dimensions
    rotate, the others pass unchanged."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin, out), x[..., r:].to(out or x.dtype)),
                         dim=-1)
    if dispatch.use_triton(x):
        return dispatch.apply_rope(x, cos, sin, out)
    return (x * cos + _rotate_half(x) * sin).to(out or x.dtype)


class GradInto:
    """A projection weight whose gradient the backward adds into ``dest`` (an fp32 buffer of the
    weight's shape) inside the matmul, instead of returning it (:func:`models.recompute.layer_backward`'s
    ``into``; kernels.dispatch.add_product_)."""
    __slots__ = ("dest", "w")

    def __init__(self, w: torch.Tensor, dest: torch.Tensor):
        self.w, self.dest = w, dest

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype


class _LinearInto(torch.autograd.Function):
    """``F.linear(x, w, b)`` whose backward gives dL/dx = go @ w and dL/db as autograd does
    and adds dL/dw = go^T @ x to ``dest`` in fp32 (no gradient is returned for w)."""

    @staticmethod
    def forward(ctx, x, w, b, dest):
        ctx.save_for_backward(x, w)
        ctx.dest = dest
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        go2 = go.reshape(-1, w.shape[0])
        dispatch.add_product_(ctx.dest, go2.t(), x.reshape(-1, w.shape[1]))
        gb = go2.sum(0) if ctx.needs_input_grad[2] else None
        return go2.mm(w).view(*go.shape[:-1], w.shape[1]), None, gb, None


def linear(p: dict, name: str, x: torch.Tensor, lora=None) -> torch.Tensor:
    """Projection ``name`` (e.g. "mlp.up_proj") of x, plus its adapter's update if ``lora``
    (an slideformer.engine.models.lora.LoraForward) has one."""
    w, b = p[name + ".weight"], p.get(name + ".bias")
    plain = w.w if isinstance(w, GradInto) else w
    if fp8.eligible(x, plain, name):  # train.precision = "fp8" (kernels.fp8)
        y = fp8.linear(x, plain, b, w.dest if isinstance(w, GradInto) else None)
    elif isinstance(w, GradInto):
        y = _LinearInto.apply(x, w.w, b, w.dest)
    else:
        y = F.linear(x, w, b)
    return y if lora is None else lora.add(name, x, y)


def attention(spec: ModelSpec, p: dict, h: torch.Tensor, rope, mask, cache=None,
              lora=None) -> torch.Tensor:
    """Self-attention of normed input h (B, T, H) -> (B, T, H).

    ``rope``: (cos, sin) tables, or None for a layer without RoPE (NoPE).
    ``cache``: a layer's KV cache (:class:`slideformer.engine.generate.cache.LayerCache`) for generation;
    the new keys and values are appended to it and the queries attend to all of them.
    ``lora``: the layer's adapters (slideformer.engine.models.lora.LoraForward), or None.
    """
    if LINEAR_MIXER in p:  # a gated DeltaNet layer: ``mask`` holds its rows' document ids
        return linear_mixer(spec, p, h, mask, cache, lora)
    nh = spec.num_heads
    if spec.family.fused:  # one projection, split after the matmul (Phi-3)
        nkv, hd = spec.num_kv_heads, spec.head_dim
        q, k, v = linear(p, "self_attn.qkv_proj", h, lora).split(
            [nh * hd, nkv * hd, nkv * hd], dim=-1)
    else:  # the layer's own head size and KV heads (Gemma 4's full layers differ)
        q = linear(p, "self_attn.q_proj", h, lora)
        k, v = kv_projections(p, h, lora)
    q, gate = query_heads(spec, p, q, rope, v.dtype)
    k, v = kv_heads(spec, p, k, v, rope, q.shape[-1])
    if cache is not None:
        k, v = cache.extend(k, v)  # (B, nkv, past + T, hd)
    # is_causal aligns the mask top-left; with cached keys the caller passes the mask
    # (one new token attends to everything: no mask at all).
    causal = mask is None and k.shape[2] == q.shape[2] and q.shape[2] > 1
    return attention_output(spec, p, q, k, v, gate, mask, causal, lora)


def kv_projections(p: dict, h: torch.Tensor, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' and values' projections of h (B, T, kv width); without v_proj (Gemma 4's
    attention_k_eq_v) the values are the keys' projection."""
    k = linear(p, "self_attn.k_proj", h, lora)
    v = linear(p, "self_attn.v_proj", h, lora) if "self_attn.v_proj.weight" in p else k
    return k, v


def query_heads(spec: ModelSpec, p: dict, q: torch.Tensor, rope, dtype: torch.dtype):
    """(q (B, nh, T, hd) normed and rotated in ``dtype``, the output gate (B, T, nh x hd) or
    None) of the queries' projection q (B, T, ...)."""
    B, T, _ = q.shape
    nh, gate = spec.num_heads, None
    hd = q.shape[-1] // (2 * nh if spec.family.attn_gate else nh)
    if spec.family.attn_gate:  # each head's [query | gate] (Qwen3.5)
        q, gate = q.view(B, T, nh, 2 * hd).chunk(2, dim=-1)  # (B, T, nh, hd) each
        q, gate = q.reshape(B, T, nh * hd), gate.reshape(B, T, nh * hd)
    tables = dtype if rope is None else rope[0].dtype
    if spec.qk_norm == "full":  # over all heads at once, before they split (OLMo 2)
        q = norm(spec, p, "self_attn.q_norm", q)
    q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
    if spec.qk_norm == "head":  # normed q in the tables' dtype: fp32 tables rotate fp32 values
        q = norm(spec, p, "self_attn.q_norm", q, tables)
    if rope is not None:
        return apply_rope(q, *rope, dtype), gate
    return q.to(dtype), gate


def kv_heads(spec: ModelSpec, p: dict, k: torch.Tensor, v: torch.Tensor, rope,
              hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, nkv, T, hd), k normed and rotated, of the projections k, v (B, T, nkv x hd)."""
    B, T, _ = k.shape
    nkv = k.shape[-1] // hd
    tables = v.dtype if rope is None else rope[0].dtype
    if spec.qk_norm == "full":
        k = norm(spec, p, "self_attn.k_norm", k)
    k = k.view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
    v = v.view(B, T, nkv, hd).transpose(1, 2)
    if spec.family.v_norm:  # per head, without a weight (Gemma 4)
        v = unit_rms(v, spec.rms_norm_eps)
    if spec.qk_norm == "head":
        k = norm(spec, p, "self_attn.k_norm", k, tables)
    if rope is not None:
        return apply_rope(k, *rope, v.dtype), v
    return k.to(v.dtype), v


def attention_output(spec: ModelSpec, p: dict, q, k, v, gate, mask, causal: bool,
                      lora=None) -> torch.Tensor:
    """The output projection of the attention of q (B, nh, T, hd) over k, v: (B, T, H)."""
    B, nh, T, hd = q.shape
    a = attend(q, k, v, mask, causal, nh != k.shape[1], spec.attn_scale,
               p.get("self_attn.sinks"))  # (B, nh, T, hd)
    a = a.transpose(1, 2).reshape(B, T, nh * hd)
    if gate is not None:
        a = a * torch.sigmoid(gate)
    return linear(p, "self_attn.o_proj", a, lora)


LINEAR_MIXER = "linear_attn.in_proj_qkv.weight"
"""A tensor only gated DeltaNet layers have (ModelSpec.is_linear)."""


def linear_mixer(spec: ModelSpec, p: dict, h: torch.Tensor, doc_ids, cache=None,
                 lora=None) -> torch.Tensor:
    """The gated DeltaNet of normed input h (B, T, H) -> (B, T, H) (models.deltanet); with a
    ``cache`` (generation: slideformer.engine.generate.cache.StateCache) it continues from the
    cache's state and leaves the new one there."""
    from slideformer.engine.models.deltanet import (
        gated_deltanet,  # it builds on this module
    )
    if cache is None:
        return gated_deltanet(spec.linear, p, h, doc_ids, lora=lora)
    y, cache.state = gated_deltanet(spec.linear, p, h, doc_ids, state=cache.begin(h), lora=lora)
    return y


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u, the gated activation of the MLP."""
    if dispatch.use_triton(g):
        return dispatch.swiglu(g, u)
    return F.silu(g) * u


def geglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(g) * u, Gemma's gated activation."""
    return F.gelu(g, approximate="tanh") * u


ACTIVATIONS = {"silu": swiglu, "gelu_tanh": geglu}


def gated(spec: ModelSpec, p: dict, h: torch.Tensor, lora=None) -> torch.Tensor:
    """The MLP up to its down projection's input: act(gate(h)) * up(h)."""
    act = ACTIVATIONS[spec.family.act]
    if spec.family.fused:  # gate, then up, in one projection (Phi-3)
        return act(*linear(p, "mlp.gate_up_proj", h, lora).chunk(2, dim=-1))
    return act(linear(p, "mlp.gate_proj", h, lora), linear(p, "mlp.up_proj", h, lora))


def feed_forward(spec: ModelSpec, p: dict, h: torch.Tensor, lora=None, aux=None) -> torch.Tensor:
    """The feed-forward of normed input h: the gated MLP, or the mixture of experts (``aux``:
    its router loss, models.moe.RouterAux)."""
    if experts_layer(spec, p):
        return moe_ffn(spec, p, h, ACTIVATIONS[spec.family.act], aux)
    return linear(p, "mlp.down_proj", gated(spec, p, h, lora), lora)


def experts_beside(spec: ModelSpec, p: dict, x: torch.Tensor, c: torch.dtype,
                   aux=None) -> torch.Tensor:
    """Gemma 4's experts beside the dense MLP, of the residual stream x (B, T, H): routed by
    x / rms(x) * router.scale / sqrt(H) (rounded as transformers rounds: in x's dtype, then to
    the compute dtype ``c`` for the router's matmul), computed on pre_feedforward_layernorm_2
    of x, normed by post_feedforward_layernorm_2 (models.moe, ``Moe.gemma4``)."""
    r = unit_rms(x, spec.rms_norm_eps) * p["router.scale"] * spec.hidden_size ** -0.5
    h = norm(spec, p, "pre_feedforward_layernorm_2", x, c)
    y = moe_ffn(spec, p, h, ACTIVATIONS[spec.family.act], aux, route_in=r.to(c))
    return norm(spec, p, "post_feedforward_layernorm_2", y)


def decoder_layer(spec: ModelSpec, p: dict, x: torch.Tensor, rope, mask=None,
                  cache=None, lora=None, aux=None, tile: int = 0) -> torch.Tensor:
    """One decoder layer: x (B, T, H) -> (B, T, H), norms placed as the family says.

    Args:
        p: parameter views of :attr:`ModelSpec.layer_layout`.
        x: the residual stream, in the weights' dtype or wider (fp32; module docstring).
        rope: (cos, sin) from :func:`rope_tables`, in x's dtype; None for a NoPE layer.
        mask: None for plain causal attention, else a boolean (B, 1, T, T) mask
            (True = may attend), e.g. block-diagonal causal for packed documents or windowed,
            or the FlexAttention BlockMask of ``kernels.attention.document_mask``; with a
            ``cache``, a boolean (T, past + T). :class:`LayerInputs` gives each layer its own.
        cache: the layer's KV cache when generating (see :func:`attention`).
        lora: the layer's adapters (slideformer.engine.models.lora.LoraForward), or None.
        aux: the micro-batch's router loss (models.moe.RouterAux) of a mixture of experts
            trained with it, or None.
        tile: run the feed-forward half (:func:`ff_block`) on this many tokens at a time
            (:func:`tiles`); 0: all at once.
    """
    m = mixer_block(spec, p, x, rope, mask, cache, lora)
    if not tiles(tile, m, aux, lora):
        return ff_block(spec, p, m, lora, aux)
    flat = m.reshape(1, -1, m.shape[-1])
    out = None
    for s in range(0, flat.shape[1], tile):  # no autograd here (models.recompute tiles its own)
        y = ff_block(spec, p, flat[:, s:s + tile], lora)
        out = flat.new_empty(flat.shape, dtype=y.dtype) if out is None else out
        out[:, s:s + tile] = y
    return out.view(m.shape)


def tiles(tile: int, x: torch.Tensor, aux=None, lora=None) -> bool:
    """Whether the feed-forward runs in tiles of ``tile`` tokens: only where tiling computes
    what the whole would, token by token. A token's feed-forward reads only that token (norms,
    MLP, a token's experts), so a long sequence's (B, T, I) intermediates shrink to (tile, I)
    and the result is the same, up to the order in which the weight gradients are summed.
    Not with a router loss (``aux``: its load-balancing term multiplies two means over the whole
    micro-batch) nor with LoRA dropout (its masks are drawn per call)."""
    return bool(tile) and x.shape[0] * x.shape[1] > tile and aux is None and \
        not (lora is not None and lora.lora.dropout)


def mixer_block(spec: ModelSpec, p: dict, x: torch.Tensor, rope, mask=None, cache=None,
                lora=None) -> torch.Tensor:
    """The first half of :func:`decoder_layer`: x plus its token mixing (attention or the gated
    DeltaNet, with the norms the family places around it): the mid residual."""
    style, c = spec.family.norm, compute_dtype(p)
    h = x.to(c) if style == "post" else norm(spec, p, "input_layernorm", x, c)
    a = attention(spec, p, h, rope, mask, cache, lora)
    if style != "pre":
        a = norm(spec, p, "post_attention_layernorm", a)
    return x + a


def ff_block(spec: ModelSpec, p: dict, x: torch.Tensor, lora=None, aux=None) -> torch.Tensor:
    """The second half of :func:`decoder_layer`: the mid residual x plus its feed-forward (the
    MLP or experts, Gemma 4's experts beside it, the norms the family places, its layer
    scalar). Token by token: no position reads another."""
    style, c = spec.family.norm, compute_dtype(p)
    h = (x.to(c) if style == "post" else
         norm(spec, p, "pre_feedforward_layernorm" if style == "sandwich"
              else "post_attention_layernorm", x, c))
    m = feed_forward(spec, p, h, lora, aux)
    if _beside(spec, p):
        m = norm(spec, p, "post_feedforward_layernorm_1", m) + experts_beside(spec, p, x, c, aux)
    if style != "pre":
        m = norm(spec, p, "post_feedforward_layernorm", m)
    if LAYER_SCALAR in p:  # a fixed buffer in transformers: no gradient reaches it
        return (x + m) * p[LAYER_SCALAR].detach()
    return x + m


LAYER_SCALAR = "layer_scalar"
"""Gemma 4's per-layer output scale (Family.layer_scalar)."""


def compute_dtype(p: dict) -> torch.dtype:
    """The dtype the layer's matmuls run in: its token mixer's output projection's (norm
    weights may be wider: runtime.norms)."""
    return p["linear_attn.out_proj.weight" if LINEAR_MIXER in p else "self_attn.o_proj.weight"].dtype


def experts_layer(spec: ModelSpec, p: dict) -> bool:
    """Whether the layer of views ``p`` computes its feed-forward with experts (a model's
    layers may differ: ModelSpec.sparse)."""
    m = spec.family.moe
    return m is not None and m.router in p and not m.gemma4


def _beside(spec: ModelSpec, p: dict) -> bool:
    """Whether the layer of views ``p`` adds Gemma 4's experts to its dense MLP."""
    m = spec.family.moe
    return m is not None and m.router in p and m.gemma4
