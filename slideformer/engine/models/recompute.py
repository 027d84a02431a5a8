"""The backward of one decoder layer: recomputed from its input, whole or in tiles.

:func:`layer_backward` recomputes a layer of models.layers from its input and backpropagates
dL/dy through it. A long micro-batch runs in tiles: of queries where attention allows it
(:func:`query_tiled_grads`: the whole layer a tile of queries at a time, keys and values
computed once), else of the feed-forward half (:func:`tiled_grads`). Every path gives the
gradients autograd gives through models.layers.decoder_layer, up to the order in which sums
over tokens add up (tests/engine/models/test_layer_backward.py).
"""
from __future__ import annotations

import torch

from slideformer.engine.kernels import dispatch
from slideformer.engine.models.layers import (
    LINEAR_MIXER,
    GradInto,
    attention_output,
    compute_dtype,
    experts_layer,
    ff_block,
    gated,
    kv_heads,
    kv_projections,
    linear,
    mixer_block,
    norm,
    query_heads,
    tiles,
)
from slideformer.engine.models.spec import ModelSpec


def plain_layer(spec: ModelSpec, p: dict) -> bool:
    """Llama's layer shape: pre-norm, a dense MLP whose down projection has no bias; its
    backward may skip the layer's output (:func:`layer_backward`)."""
    return spec.family.norm == "pre" and not experts_layer(spec, p) and "mlp.down_proj.bias" not in p



class _DownGrads(torch.autograd.Function):
    """y = x1 + down_proj(z) for a backward only: the forward forms no output (a broadcast
    zero of y's shape stands for it), the backward gives dL/dx1 = gy and the matmuls autograd
    makes for ``F.linear`` without a bias: dL/dz = go @ W, dL/dW = go^T @ z (go = gy in z's
    dtype), or adds dL/dW to ``dest`` (:class:`GradInto`). z is saved and freed as autograd
    frees the projection's saved input."""

    @staticmethod
    def forward(ctx, x1, z, w, dest=None):
        ctx.save_for_backward(z, w)
        ctx.dest = dest
        return x1.new_zeros(()).expand(x1.shape)

    @staticmethod
    def backward(ctx, gy):
        z, w = ctx.saved_tensors
        go = gy.to(z.dtype).reshape(-1, w.shape[0])
        z2 = z.reshape(-1, w.shape[1])
        if ctx.dest is None:
            return gy, go.mm(w).view(z.shape), go.t().mm(z2), None
        dispatch.add_product_(ctx.dest, go.t(), z2)
        return gy, go.mm(w).view(z.shape), None, None


def layer_backward(spec: ModelSpec, leaves: dict, x: torch.Tensor, gy: torch.Tensor, rope,
                   mask=None, into: dict | None = None, aux=None,
                   tile: int = 0) -> tuple[torch.Tensor, dict]:
    """Recompute one decoder layer from its input ``x`` and backpropagate ``gy`` = dL/dy:
    (dL/dx, {name: dL/d leaf}) for the parameter ``leaves`` (tensors that require grad).

    ``into``: {name: fp32 buffer} for projection weights (``*_proj.weight``, in ``leaves`` as
    plain tensors) whose gradient is added to the buffer inside its matmul
    (kernels.dispatch.add_product_) instead of being returned; the CUDA path of the executor,
    where no compute-dtype copy of those gradients is then formed.

    The layer's output is never formed (:class:`_DownGrads`), so the recompute skips the down
    projection's forward: a quarter of a Llama layer's forward matmuls, ~6% of a full
    fine-tuning step's FLOPs, and one hidden state per token of memory. Without ``into`` every
    gradient is the one autograd gives through :func:`decoder_layer` (the same calls; tests
    compare them with ``torch.equal``). Other layer shapes (a down projection with a bias,
    post or sandwich norms, experts) keep the plain autograd path; ``aux`` (models.moe.RouterAux)
    adds the router loss's terms of this layer to what is backpropagated. ``tile``: the
    layer in tiles of that many tokens, of queries where attention allows it
    (:func:`query_tiled_grads`), else of its feed-forward half (:func:`tiled_grads`).
    """
    into = into or {}
    x = x.detach().requires_grad_()
    p = {k: GradInto(v, into[k]) if k in into else v for k, v in leaves.items()}
    names = [k for k in leaves if k not in into]
    wanted = [leaves[k] for k in names]
    plain = plain_layer(spec, leaves)
    if plain:  # one expression: the graph alone keeps the mid residual and z alive
        c, down = compute_dtype(leaves), leaves["mlp.down_proj.weight"]
        ff = lambda m: _DownGrads.apply(
            m, gated(spec, p, norm(spec, p, "post_attention_layernorm", m, c)), down,
            into.get("mlp.down_proj.weight"))
    else:
        ff = lambda m: ff_block(spec, p, m, aux=aux)
    if query_tiles(spec, leaves, x, mask, tile, aux):
        gx, grads = query_tiled_grads(spec, p, ff, x, gy, wanted, rope, mask, tile)
        return gx, dict(zip(names, grads))
    if tiles(tile, x, aux):
        gx, grads = tiled_grads(lambda v: mixer_block(spec, p, v, rope, mask), ff, x, gy,
                                wanted, tile)
        return gx, dict(zip(names, grads))
    with torch.enable_grad():
        y = ff(mixer_block(spec, p, x, rope, mask))
        terms = aux.take() if aux is not None else []
        # materialize: a leaf the layer reads without a gradient (Gemma 4's layer_scalar) gets 0
        grads = torch.autograd.grad([y, *terms], [x, *wanted],
                                    [gy, *(torch.ones_like(t) for t in terms)],
                                    materialize_grads=True)
    return grads[0], dict(zip(names, grads[1:]))


def query_tiles(spec: ModelSpec, p: dict, x: torch.Tensor, mask, tile: int, aux=None,
                lora=None) -> bool:
    """Whether the layer's backward runs in tiles of queries (:func:`query_tiled_grads`): as
    :func:`tiles`, for attention with its own q, k and v projections (not Phi-3's fused one,
    nor a gated DeltaNet, whose recurrence reads every earlier position), no sinks, and plain
    causal rows or a boolean mask (a FlexAttention BlockMask is not cut into query rows)."""
    return (tiles(tile, x, aux, lora) and x.shape[1] > max(1, tile // x.shape[0])
            and LINEAR_MIXER not in p and not spec.family.fused and "self_attn.sinks" not in p
            and (mask is None or type(mask) is torch.Tensor))


def query_tiled_grads(spec: ModelSpec, p: dict, ff, x: torch.Tensor, gy: torch.Tensor,
                      params: list[torch.Tensor], rope, mask, tile: int, lora=None
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """dL/dx and dL/d ``params`` of y = ff(mixer_block(x)) for dL/dy = ``gy``, the whole layer
    recomputed and backpropagated a tile of queries at a time (``tile`` tokens: tile // B
    positions of every row), so that one long sequence holds a tile's activations, not the
    sequence's.

    Keys and values are the only part of a layer a position reads from others: they are
    computed once for every position (without autograd), and each tile computes its queries,
    attends them to the keys up to its last position (causal, aligned to the bottom right; or
    its rows of the boolean ``mask``), adds the output projection and the token-wise
    feed-forward, and backpropagates at once, summing dL/dk and dL/dv in fp32. A last pass,
    tile by tile again, recomputes each tile's keys and values with autograd and takes their
    sums through the keys' and values' projections and the input norm. Only k, v, their fp32
    sums and dL/dx span the sequence. The same maths as the whole layer, up to the order in
    which the sums over tokens add up (tests compare them)."""
    B, T, _ = x.shape
    qt = max(1, tile // B)
    style, c, nh = spec.family.norm, compute_dtype(p), spec.num_heads
    wq = p["self_attn.q_proj.weight"]
    hd = (wq.w if isinstance(wq, GradInto) else wq).shape[0] // (
        2 * nh if spec.family.attn_gate else nh)

    def normed(v):
        return v.to(c) if style == "post" else norm(spec, p, "input_layernorm", v, c)
    def keys(xt, rt):
        return kv_heads(spec, p, *kv_projections(p, normed(xt), lora), rt, hd)

    def tables(s, e):
        return None if rope is None else tuple(t[:, :, s:e].contiguous() for t in rope)
    with torch.no_grad():
        k, v = keys(x, rope)
    gk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    gv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    gx = torch.empty_like(x)
    acc: list[torch.Tensor | None] = [None] * len(params)
    for s in range(0, T, qt):
        e = min(T, s + qt)
        xt = x[:, s:e].detach().contiguous().requires_grad_()
        ks = k.detach()[:, :, :e].requires_grad_()
        vs = v.detach()[:, :, :e].requires_grad_()
        rt, (mt, causal) = tables(s, e), _tile_mask(mask, s, e)
        with torch.enable_grad():
            q, gate = query_heads(spec, p, linear(p, "self_attn.q_proj", normed(xt), lora),
                                   rt, v.dtype)
            a = attention_output(spec, p, q, ks, vs, gate, mt, causal, lora)
            if style != "pre":
                a = norm(spec, p, "post_attention_layernorm", a)
            y = ff(xt + a)
            got = torch.autograd.grad(y, [xt, ks, vs, *params], gy[:, s:e].contiguous(),
                                      allow_unused=True)
        gx[:, s:e] = got[0]
        gk[:, :, :e] += got[1]
        gv[:, :, :e] += got[2]
        acc = _sum_grads(acc, got[3:])
        del q, gate, a, y, got, xt, ks, vs
    for s in range(0, T, qt):  # dL/dk, dL/dv through the keys' and values' projections
        e = min(T, s + qt)
        xt = x[:, s:e].detach().contiguous().requires_grad_()
        with torch.enable_grad():
            kt, vt = keys(xt, tables(s, e))
            got = torch.autograd.grad([kt, vt], [xt, *params], [gk[:, :, s:e].to(kt.dtype),
                                                                gv[:, :, s:e].to(vt.dtype)],
                                      allow_unused=True)
        gx[:, s:e] += got[0]
        acc = _sum_grads(acc, got[1:])
        del kt, vt, got, xt
    return gx, _as_params(params, acc)


def _tile_mask(mask, s: int, e: int):
    """(mask, causal) for the queries s..e-1 over the keys 0..e-1: the rows of a boolean
    ``mask``, else causal rows aligned to the bottom right (a square first tile, or one query
    that sees every key, needs no mask)."""
    from torch.nn.attention.bias import causal_lower_right
    if mask is not None:
        return mask[..., s:e, :e], False
    if s == 0 or e - s == 1:
        return None, s == 0 and e > 1
    return causal_lower_right(e - s, e), False


def _sum_grads(sums: list, grads) -> list:
    """Tile-by-tile sums of parameter grads, in fp32 (one rounding at the end)."""
    return [a if g is None else g.float() if a is None else a.add_(g) for a, g in zip(sums, grads)]


def _as_params(params: list[torch.Tensor], sums: list) -> list[torch.Tensor]:
    """The sums in each parameter's dtype (a leaf no tile read gets 0)."""
    return [torch.zeros_like(w) if g is None else g.to(w.dtype) for w, g in zip(params, sums)]


def tiled_grads(mixer, ff, x: torch.Tensor, gy: torch.Tensor, params: list[torch.Tensor],
                tile: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """dL/dx and dL/d ``params`` of y = ff(mixer(x)) for dL/dy = ``gy``, the token-wise ``ff``
    recomputed and backpropagated ``tile`` tokens at a time: the mixer's graph is kept whole
    (attention reads every position), each tile's feed-forward graph lives only while its
    backward runs, and the tiles' dL/d(mid residual) joins into one tensor for the mixer's
    backward. Parameter grads are summed over the tiles (a leaf neither half reads gets 0)."""
    with torch.enable_grad():
        m = mixer(x)
    flat = m.detach().reshape(1, -1, m.shape[-1])
    g_out, g_mid = gy.reshape(flat.shape), torch.empty_like(flat)
    acc: list[torch.Tensor | None] = [None] * len(params)  # fp32: one rounding at the end
    for s in range(0, flat.shape[1], tile):
        part = flat[:, s:s + tile].requires_grad_()
        with torch.enable_grad():
            y = ff(part)
            got = torch.autograd.grad(y, [part, *params], g_out[:, s:s + tile], allow_unused=True)
        g_mid[:, s:s + tile] = got[0]
        acc = _sum_grads(acc, got[1:])
        del y, got, part
    got = torch.autograd.grad(m, [x, *params], g_mid.view(m.shape), allow_unused=True)
    return got[0], _as_params(params, _sum_grads(acc, got[1:]))
