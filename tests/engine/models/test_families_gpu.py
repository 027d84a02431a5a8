"""The new families' GPU paths against their CPU references: the experts' grouped matmuls
(``F.grouped_mm``, one kernel per projection) against the loop over expert blocks, and the
sliding window as a FlexAttention BlockMask against the boolean mask; then every family's
layer in bf16 on the GPU against the same layer in fp32."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from slideformer.engine.kernels.attention import (attend, document_block_mask,  # noqa: E402
                                                  flex_available, packed_causal_mask)
from slideformer.engine.kernels.dispatch import LAUNCHES  # noqa: E402
from slideformer.engine.models import moe  # noqa: E402
from slideformer.engine.models.spec import SUPPORTED, spec_from_config  # noqa: E402
from slideformer.engine.models.layers import decoder_layer, rope_tables  # noqa: E402
from slideformer.engine.models.tiny import TinyShape, random_tensors, tiny_config  # noqa: E402
from slideformer.engine.models.weights import item_layout  # noqa: E402


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tokens,experts,in_out", [(1000, 8, False), (4096, 128, False),
                                                    (7, 16, False), (1000, 8, True),
                                                    (7, 16, True)])
@pytest.mark.parametrize("offset", [0, 1])
def test_grouped_experts_match_the_loop(tokens, experts, in_out, offset):
    """Forward and gradients of the three grouped projections, with empty experts included;
    ``in_out``: GPT-OSS's (E, in, out) storage; ``offset``: the experts at that many elements
    into a flat buffer, as a layer's buffer holds them (1: 2 bytes past an aligned address)."""
    g = torch.Generator("cuda").manual_seed(0)
    H, I = 256, 128
    ids = torch.randint(0, experts, (tokens,), generator=g, device="cuda")
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts)
    x = torch.randn(tokens, H, generator=g, device="cuda").to(torch.bfloat16)[order]
    w = (torch.randn(experts, I, H, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    w = w.transpose(1, 2).contiguous() if in_out else w
    gy = torch.randn(tokens, I, generator=g, device="cuda").to(torch.bfloat16)
    out = {}
    for path in ("grouped", "loop"):
        xs = x.clone().requires_grad_()
        flat = torch.zeros(w.numel() + offset, dtype=w.dtype, device=w.device)
        flat[offset:].copy_(w.reshape(-1))
        ws = flat.requires_grad_()
        wv = ws[offset:].view(w.shape)
        ends = counts.cumsum(0).to(torch.int32) if path == "grouped" else None
        before = LAUNCHES["grouped_mm"]
        y = moe.grouped_linear(xs, wv, counts, ends, in_out=in_out)
        assert (LAUNCHES["grouped_mm"] > before) == (path == "grouped")
        y.backward(gy)
        out[path] = (y, xs.grad, ws.grad[offset:].view(w.shape))
    for a, b in zip(out["grouped"], out["loop"]):
        assert rel(a, b) < 1e-2


@pytest.mark.skipif(not flex_available("cuda", 64), reason="no FlexAttention")
@pytest.mark.parametrize("T,window", [(256, 64), (300, 128), (1024, 512)])
def test_windowed_block_mask_matches_the_boolean_mask(T, window):
    g = torch.Generator("cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 4, T, 64, generator=g, device="cuda").to(torch.bfloat16)
               for _ in range(3))
    doc = (torch.arange(T, device="cuda") >= T // 3).long().expand(2, T).contiguous()
    ref = attend(q, k, v, packed_causal_mask(doc, window), False, False)
    got = attend(q, k, v, document_block_mask(doc, window), False, False)
    assert rel(got, ref) < 1e-2


@pytest.mark.skipif(not flex_available("cuda", 64), reason="no FlexAttention")
@pytest.mark.parametrize("T,window,gqa", [(256, None, False), (300, 128, True), (1024, None, True)])
def test_sinks_through_flex_lse_match_the_scores(T, window, gqa):
    """Attention sinks from FlexAttention's differentiable log-sum-exp (plain causal rows, and
    a windowed document mask) against the scores formed in fp32: output and the gradients of
    q, k, v and the sinks."""
    g = torch.Generator("cuda").manual_seed(3)
    nkv = 2 if gqa else 4
    q = torch.randn(2, 4, T, 64, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, nkv, T, 64, generator=g, device="cuda").to(torch.bfloat16)
            for _ in range(2))
    sinks = torch.randn(4, generator=g, device="cuda")
    gy = torch.randn(2, 4, T, 64, generator=g, device="cuda").to(torch.bfloat16)
    doc = (torch.arange(T, device="cuda") >= T // 3).long().expand(2, T).contiguous()
    out = {}
    for path in ("flex", "reference"):  # the reference: fp32 on the CPU
        leaves = [(t if path == "flex" else t.cpu().float()).clone().requires_grad_()
                  for t in (q, k, v, sinks)]
        if window is None:
            mask = None
        else:
            mask = document_block_mask(doc, window) if path == "flex" \
                else packed_causal_mask(doc.cpu(), window)
        before = LAUNCHES["flex_attention"]
        y = attend(*leaves[:3], mask, mask is None, gqa, None, leaves[3])
        assert (LAUNCHES["flex_attention"] > before) == (path == "flex")
        y.backward(gy.to(y.device, y.dtype))
        out[path] = (y, *(t.grad for t in leaves))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), out["flex"], out["reference"]):
        assert rel(a.cpu(), b) < 2e-2, name


@pytest.mark.parametrize("arch", SUPPORTED)
def test_layer_in_bf16_on_the_gpu_matches_fp32(arch):
    """One decoder layer of each kind a family has (e.g. Qwen3.5's gated DeltaNet, through
    fla where installed, and its gated attention) on the GPU's kernels (fused norms, RoPE,
    grouped experts, the window) in bf16, against the same layer in fp32 on the CPU."""
    spec = spec_from_config(tiny_config(arch, TinyShape(hidden=256, heads=4, kv_heads=2,
                                                        intermediate=512)))
    kinds = {spec.block(i): i for i in reversed(range(spec.num_layers))}  # first of each kind
    x = torch.randn(2, 40, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(40).expand(2, 40)
    for i in sorted(kinds.values()):
        layout = item_layout(spec, f"layer{i}")
        flat = torch.cat([t.reshape(-1) for name, t in random_tensors(spec, 0)
                          if f".layers.{i}." in name])  # the layer's tensors, experts one by one
        assert flat.numel() == layout.numel
        outs = []
        for dev, dt in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
            p = layout.views(flat.to(dev, dt))
            rope = rope_tables(spec, pos.to(dev), dt, head_dim=spec.head_dim_of(i)) \
                if spec.has_rope(i) else None  # Gemma 4's full layers: heads of their own
            outs.append(decoder_layer(spec, p, x.to(dev, dt), rope).cpu())
        assert rel(outs[1], outs[0]) < 3e-2, f"layer {i}"
