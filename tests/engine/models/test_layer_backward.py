"""layer_backward (the executor's recompute + backward without the layer's output) against
autograd through decoder_layer: the same bits on the CPU, for every family, dtype and mask."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.kernels.attention import packed_causal_mask
from slideformer.engine.models.layers import decoder_layer, rope_tables
from slideformer.engine.models.recompute import layer_backward
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config


def autograd_reference(spec, leaves, x, gy, rope, mask):
    xi = x.detach().requires_grad_()
    with torch.enable_grad():
        y = decoder_layer(spec, leaves, xi, rope, mask)
        grads = torch.autograd.grad(y, [xi, *leaves.values()], gy)
    return grads[0], dict(zip(leaves, grads[1:]))


def case(arch, dtype, residual, mlp_bias=False, B=2, T=24, seed=0):
    cfg = tiny_config(arch, TinyShape(layers=1))
    if mlp_bias:
        cfg["mlp_bias"] = True
    spec = spec_from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    flat = (torch.randn(spec.params_per_layer, generator=g) * 0.1).to(dtype)
    leaves = {k: v.detach().requires_grad_() for k, v in spec.layer_layout.views(flat).items()}
    x = torch.randn(B, T, spec.hidden_size, generator=g).to(residual)
    gy = torch.randn(B, T, spec.hidden_size, generator=g).to(residual)
    rope = rope_tables(spec, torch.arange(T).expand(B, T), residual)
    return spec, leaves, x, gy, rope


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype,residual", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("packed", [False, True])
def test_layer_backward_equals_autograd_through_the_whole_layer(arch, dtype, residual, packed):
    spec, leaves, x, gy, rope = case(arch, dtype, residual)
    doc = torch.tensor([0] * 10 + [1] * 14).expand(2, 24)
    mask = packed_causal_mask(doc) if packed else None
    gx, grads = layer_backward(spec, leaves, x, gy, rope, mask)
    ref_gx, ref = autograd_reference(spec, leaves, x, gy, rope, mask)
    assert list(grads) == list(ref), "grads come back in the layout's order"
    assert gx.dtype == ref_gx.dtype and torch.equal(gx, ref_gx)
    for name in ref:
        assert grads[name].dtype == ref[name].dtype, name
        assert torch.equal(grads[name], ref[name]), name


def test_a_down_projection_bias_keeps_the_autograd_path():
    spec, leaves, x, gy, rope = case("llama", torch.float32, torch.float32, mlp_bias=True)
    assert "mlp.down_proj.bias" in leaves
    gx, grads = layer_backward(spec, leaves, x, gy, rope)
    ref_gx, ref = autograd_reference(spec, leaves, x, gy, rope, None)
    assert torch.equal(gx, ref_gx) and all(torch.equal(grads[n], ref[n]) for n in ref)


def test_the_down_projection_output_is_never_computed(monkeypatch):
    """The point of it: F.linear runs for every projection but the down one."""
    import torch.nn.functional as F
    from slideformer.engine.models import layers
    spec, leaves, x, gy, rope = case("llama", torch.float32, torch.float32)
    seen = []
    real = F.linear

    def counting(inp, w, b=None):
        seen.append(tuple(w.shape))
        return real(inp, w, b)
    monkeypatch.setattr(layers.F, "linear", counting)
    layer_backward(spec, leaves, x, gy, rope)
    assert tuple(leaves["mlp.down_proj.weight"].shape) not in seen
    assert len(seen) == 6  # q, k, v, o, gate, up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("residual", [torch.bfloat16, torch.float32])
def test_layer_backward_on_cuda_with_the_fused_kernels(arch, residual):
    """CUDA, bf16 weights, the engine's default kernels: the gradients equal autograd's
    through decoder_layer (the same cuBLAS calls)."""
    spec, leaves, x, gy, rope = case(arch, torch.bfloat16, residual, B=4, T=256)
    leaves = {k: v.detach().cuda().requires_grad_() for k, v in leaves.items()}
    x, gy = x.cuda(), gy.cuda()
    rope = tuple(t.cuda() for t in rope)
    gx, grads = layer_backward(spec, leaves, x, gy, rope)
    ref_gx, ref = autograd_reference(spec, leaves, x, gy, rope, None)
    assert torch.equal(gx, ref_gx)
    for name in ref:
        assert torch.equal(grads[name], ref[name]), name


def _into(spec, leaves, seed=1, device="cpu"):
    """fp32 buffers for the projection weights, starting from random values (they are added to)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(device) for k, v in leaves.items()
            if k.endswith("_proj.weight")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype,residual", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
def test_gradients_added_into_buffers_equal_the_returned_ones(arch, dtype, residual):
    """``into``: the projection weights' gradients are added to fp32 buffers, the others come
    back as before. On the CPU the product is formed in the compute dtype and added, so the
    buffers hold exactly start + autograd's gradient (upcast), and dL/dx is autograd's."""
    spec, leaves, x, gy, rope = case(arch, dtype, residual)
    ref_gx, ref = autograd_reference(spec, leaves, x, gy, rope, None)
    into = _into(spec, leaves)
    start = {k: v.clone() for k, v in into.items()}
    plain = {k: v.detach() if k in into else v for k, v in leaves.items()}
    gx, grads = layer_backward(spec, plain, x, gy, rope, None, into)
    assert torch.equal(gx, ref_gx)
    assert set(grads) == set(ref) - set(into) and set(into)  # norms, biases come back
    for name in grads:
        assert torch.equal(grads[name], ref[name]), name
    for name, buf in into.items():
        assert buf.dtype == torch.float32
        assert torch.equal(buf, start[name] + ref[name].float()), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gradients_accumulate_in_fp32_inside_the_matmul_on_cuda(arch):
    """CUDA, bf16: the buffers receive the fp32 product (dispatch.fp32_accumulate), closer to
    the exact gradient than autograd's bf16 one; dL/dx agrees with autograd's."""
    from slideformer.engine.kernels.dispatch import fp32_accumulate
    assert fp32_accumulate("cuda")
    spec, leaves, x, gy, rope = case(arch, torch.bfloat16, torch.bfloat16, B=4, T=256)
    leaves = {k: v.detach().cuda().requires_grad_() for k, v in leaves.items()}
    x, gy = x.cuda(), gy.cuda()
    rope = tuple(t.cuda() for t in rope)
    ref_gx, ref = autograd_reference(spec, leaves, x, gy, rope, None)
    into = {k: torch.zeros(v.shape, device="cuda") for k, v in leaves.items()
            if k.endswith("_proj.weight")}
    plain = {k: v.detach() if k in into else v for k, v in leaves.items()}
    gx, grads = layer_backward(spec, plain, x, gy, rope, None, into)
    torch.testing.assert_close(gx, ref_gx, rtol=2e-2, atol=1e-3)
    for name in grads:
        assert torch.equal(grads[name], ref[name]), name
    for name, buf in into.items():  # the bf16 rounding of autograd's gradient bounds the gap
        gap = float((buf - ref[name].float()).abs().max())
        assert gap <= 2 ** -7 * float(ref[name].float().abs().max()), name


# ---- the feed-forward in tiles of tokens (long sequences) -----------------------------------------
def family_layer(arch, layer, B=2, T=24, seed=0, dtype=torch.float32):
    """Layer ``layer`` of a tiny ``arch`` model (tiny_config puts every layer type in 4 layers)."""
    spec = spec_from_config(tiny_config(arch, TinyShape(layers=4)))
    g = torch.Generator().manual_seed(seed)
    lay = spec.layout(layer)
    flat = (torch.randn(lay.numel, generator=g) * 0.1).to(dtype)
    leaves = {k: v.detach().requires_grad_() for k, v in lay.views(flat).items()}
    x = torch.randn(B, T, spec.hidden_size, generator=g).to(dtype)
    gy = torch.randn(B, T, spec.hidden_size, generator=g).to(dtype)
    from slideformer.engine.models.inputs import LayerInputs
    from slideformer.engine.models.model import positions_for
    inp = LayerInputs(spec, positions_for(torch.zeros(B, T, dtype=torch.long), None), dtype, None,
                      None)
    return spec, leaves, x, gy, inp.at(layer)


def assert_near(a, b, what=""):
    """Within fp32 summation noise: the tiles sum a gradient's tokens in another order."""
    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert rel < 2e-6, f"{what}: relative difference {rel:.1e}"


TILED = [(a, i) for a in ("llama", "qwen3", "olmo2", "gemma3_text", "phi3", "qwen3_moe",
                          "gpt_oss") for i in (0, 1)] + \
        [("gemma4_text", i) for i in range(4)] + [("qwen3_5_text", i) for i in (0, 3)] + \
        [("qwen3_5_moe_text", 0)]


FF_TILED_ONLY = {"phi3", "gpt_oss"}
"""Families whose layers tile their feed-forward only (models.recompute.query_tiles): Phi-3's
fused projection, GPT-OSS's sinks; and the gated DeltaNet layers of Qwen3.5."""


@pytest.mark.parametrize("arch,layer", TILED)
def test_feed_forward_in_tiles_equals_the_whole_layer(arch, layer, monkeypatch):
    """Every layer style (pre, post and sandwich norms, Phi-3's fused gate-up, experts, GPT-OSS's
    sinks and biases, Gemma 4's experts beside the MLP and layer scalar, the gated DeltaNet as the
    mixer): the forward and the recompute + backward in tiles of 7 tokens (48 tokens: the last
    tile partial) give the untiled layer's output and gradients, up to the order of summation.
    The backward tiles the queries where attention allows it (3 positions of both rows a tile)."""
    from slideformer.engine.models import layers, recompute
    spec, leaves, x, gy, (rope, mask) = family_layer(arch, layer)
    with torch.no_grad():
        ref_y = decoder_layer(spec, leaves, x, rope, mask)
    ref_gx, ref = layer_backward(spec, leaves, x, gy, rope, mask)
    calls = {"ff_block": [], "tiled_grads": [], "query_tiled_grads": []}
    for fn in calls:
        mod = layers if fn == "ff_block" else recompute
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _r=real, _n=fn, **k: calls[_n].append(1) or _r(*a, **k))
    with torch.no_grad():
        assert_near(decoder_layer(spec, leaves, x, rope, mask, tile=7), ref_y, "output")
    assert len(calls["ff_block"]) == 7  # 48 tokens in tiles of 7
    gx, grads = layer_backward(spec, leaves, x, gy, rope, mask, tile=7)
    linear = layers.LINEAR_MIXER in leaves
    queries = arch not in FF_TILED_ONLY and not linear
    assert (len(calls["query_tiled_grads"]), len(calls["tiled_grads"])) == \
        ((1, 0) if queries else (0, 1))
    assert list(grads) == list(ref)
    assert_near(gx, ref_gx, "dL/dx")
    for name in ref:
        assert_near(grads[name], ref[name], name)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("T,tile", [(24, 8), (24, 2), (23, 10), (40, 46)])
def test_query_tiles_with_a_document_mask_equal_the_whole_layer(arch, T, tile):
    """Packed rows (a boolean mask cut into each tile's rows) and tiles of one position (a
    query that sees every key of its rows' prefix), partial last tiles: the same gradients."""
    from slideformer.engine.models.recompute import query_tiles
    spec, leaves, x, gy, (rope, _) = family_layer(arch, 0, T=T)
    doc = torch.tensor([0] * (T // 3) + [1] * (T - T // 3 - 2) + [2] * 2).expand(2, T)
    mask = packed_causal_mask(doc)
    assert query_tiles(spec, leaves, x, mask, tile)
    ref_gx, ref = layer_backward(spec, leaves, x, gy, rope, mask)
    gx, grads = layer_backward(spec, leaves, x, gy, rope, mask, tile=tile)
    assert_near(gx, ref_gx, "dL/dx")
    for name in ref:
        assert_near(grads[name], ref[name], name)


def test_query_tiles_only_where_attention_allows_them():
    """Not for a FlexAttention BlockMask, GPT-OSS's sinks, Phi-3's fused projection, the gated
    DeltaNet, nor rows short enough for one tile."""
    from slideformer.engine.kernels.attention import document_block_mask
    from slideformer.engine.models.layers import LINEAR_MIXER
    from slideformer.engine.models.recompute import query_tiles
    spec, leaves, x, *_ = family_layer("llama", 0)
    assert query_tiles(spec, leaves, x, None, 8) and not query_tiles(spec, leaves, x, None, 48)
    assert not query_tiles(spec, leaves, x, None, 0)
    block = document_block_mask(torch.zeros(2, 24, dtype=torch.long))
    assert not query_tiles(spec, leaves, x, block, 8)
    for arch, layer in (("gpt_oss", 0), ("phi3", 0), ("qwen3_5_text", 0)):
        spec, leaves, x, *_ = family_layer(arch, layer)
        assert not query_tiles(spec, leaves, x, None, 8), arch
    assert LINEAR_MIXER in leaves


def test_tiles_add_projection_grads_into_their_buffers():
    """The executor's ``into`` path: each tile's weight-gradient product is added to the fp32
    buffer, so the buffers end as the untiled layer's gradients."""
    spec, leaves, x, gy, (rope, mask) = family_layer("llama", 0)
    names = [n for n in leaves if n.endswith("_proj.weight")]
    bufs = {n: torch.zeros_like(leaves[n]) for n in names}
    plain = {k: v.detach() if k in bufs else v for k, v in leaves.items()}
    gx, grads = layer_backward(spec, plain, x, gy, rope, mask, into=bufs, tile=5)
    ref_gx, ref = layer_backward(spec, leaves, x, gy, rope, mask)
    assert_near(gx, ref_gx, "dL/dx")
    assert set(grads) == set(ref) - set(names)
    for n in names:
        assert_near(bufs[n], ref[n], n)


def test_no_tiles_with_a_router_loss_or_lora_dropout():
    """Tiling would change what these compute: the router loss multiplies two means over the
    micro-batch, and LoRA dropout draws its masks per call."""
    from types import SimpleNamespace

    from slideformer.engine.models.layers import tiles
    x = torch.zeros(1, 64, 8)
    assert tiles(16, x) and not tiles(64, x) and not tiles(0, x)
    assert not tiles(16, x, aux=object())
    assert not tiles(16, x, lora=SimpleNamespace(lora=SimpleNamespace(dropout=0.1)))
    assert tiles(16, x, lora=SimpleNamespace(lora=SimpleNamespace(dropout=0.0)))


def test_bf16_tiles_sum_their_gradients_in_fp32():
    """bf16 leaves: each tile's gradient is summed in fp32 and rounded once, so the tiled
    gradients sit within bf16's rounding of the untiled ones (a sum rounded per tile drifts)."""
    spec, leaves, x, gy, (rope, mask) = family_layer("qwen3", 0, dtype=torch.bfloat16, T=64)
    gx, grads = layer_backward(spec, leaves, x, gy, rope, mask, tile=8)
    ref_gx, ref = layer_backward(spec, leaves, x, gy, rope, mask)
    for name in ref:
        assert grads[name].dtype == torch.bfloat16
        rel = ((grads[name].float() - ref[name].float()).norm() / ref[name].float().norm()).item()
        assert rel < 8e-3, f"{name}: {rel:.1e}"


BF16_TILE_SLACK = 3.0
"""How much farther from the fp32 layer a bf16 layer's tiled gradients may be than its untiled
ones. The tiles round at other points (each tile's partial sums; dL/dk and dL/dv once, summed in
fp32) and gradients with heavy cancellation, like the 16 numbers of a q_norm weight summed over
every token and head, move by a few 1e-3: on the H100, Gemma 3's q_norm weight's tiled gradient
was 1.11e-2 from the fp32 layer's and the untiled one's 0.64e-2; on the CPU k_norm's 0.75e-2 and
0.65e-2. A tile lost or counted twice moves a gradient by about one tile's share (25% and more
here)."""


@pytest.mark.parametrize("arch,layer", [("llama", 0), ("gemma3_text", 0), ("gemma4_text", 0),
                                        ("gemma4_text", 3)])
def test_bf16_query_tiles_are_as_near_the_fp32_layer_as_the_whole(arch, layer):
    """In bf16 on the CPU, 16 tiles of 16 queries: every gradient of the tiled layer is about as
    near the fp32 layer's as the untiled bf16 layer's is (:data:`BF16_TILE_SLACK`)."""
    from slideformer.engine.models.recompute import query_tiles
    spec, leaves, x, gy, (rope, mask) = family_layer(arch, layer, B=1, T=256)
    assert query_tiles(spec, leaves, x, mask, 16)
    results = []
    for dt, tile in ((torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 16)):
        lv = {k: v.detach().to(dt).requires_grad_() for k, v in leaves.items()}
        gx, grads = layer_backward(spec, lv, x.to(dt), gy.to(dt),
                                   None if rope is None else tuple(t.to(dt) for t in rope),
                                   mask, tile=tile)
        results.append((gx.float(), {k: g.float() for k, g in grads.items()}))
    (ref_gx, ref), (whole_gx, whole), (gx, got) = results
    for name, a, w, b in [("dL/dx", gx, whole_gx, ref_gx)] + [(n, got[n], whole[n], ref[n])
                                                            for n in ref]:
        if not b.any():  # a leaf the layer reads without a gradient (Gemma 4's layer_scalar)
            assert not a.any() and not w.any(), name
            continue
        err, base = ((a - b).norm() / b.norm()).item(), ((w - b).norm() / b.norm()).item()
        assert err <= BF16_TILE_SLACK * base + 1e-3, (name, err, base)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_query_tiles_on_cuda_match_the_whole_layer(arch, device="cuda"):
    """bf16 on the GPU (the fused kernels, flash attention aligned to the bottom right for each
    tile of queries, the projection grads added into fp32 buffers): the tiled layer's
    gradients about as close to the fp32 layer's as the untiled bf16 layer's are
    (:data:`BF16_TILE_SLACK`)."""
    from slideformer.engine.models.recompute import query_tiles
    spec, leaves, x, gy, (rope, mask) = family_layer(arch, 0, B=1, T=2048, dtype=torch.bfloat16)
    assert query_tiles(spec, leaves, x, mask, 512)
    names = [n for n in leaves if n.endswith("_proj.weight")]
    results = []
    for dt, tile in ((torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 512)):
        lv = {k: v.detach().to(device, dt).requires_grad_() for k, v in leaves.items()}
        bufs = {n: torch.zeros(lv[n].shape, device=device) for n in names}
        plain = {k: v.detach() if k in bufs else v for k, v in lv.items()}
        gx, grads = layer_backward(spec, plain, x.to(device, dt), gy.to(device, dt),
                                   tuple(t.to(device, dt) for t in rope), mask, into=bufs,
                                   tile=tile)
        results.append((gx.float(), {**{k: g.float() for k, g in grads.items()}, **bufs}))
    (ref_gx, ref), (whole_gx, whole), (gx, got) = results

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    for name, a, w, b in [("dL/dx", gx, whole_gx, ref_gx)] + [(n, got[n], whole[n], ref[n])
                                                            for n in ref]:
        assert rel(a, b) <= BF16_TILE_SLACK * rel(w, b) + 1e-3, (name, rel(a, b), rel(w, b))
