"""NF4 with double-quantised scales against bitsandbytes (the reference implementation, CPU)."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.models.spec import Layout
from slideformer.engine.runtime.nf4 import DYNAMIC, NF4, Nf4Layout

bnb = pytest.importorskip("bitsandbytes.functional")

LAYOUT = Layout.build([("input_layernorm.weight", (96,)), ("a.weight", (96, 640)),
                       ("b.bias", (128,)), ("b.weight", (128, 64)), ("c.weight", (3, 64))])


def quantized(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(LAYOUT.numel, generator=g) * 0.02
    flat[100:164] = 0.0  # an all-zero block
    flat[200] = 0.5  # an outlier
    q = Nf4Layout.build(LAYOUT, dtype)
    return flat, q, q.quantize(flat, torch.zeros(q.nbytes, dtype=torch.uint8))


def bnb_state(q, buf, t, dtype):
    """bitsandbytes' QuantState holding our codes and scales for tensor ``t``."""
    ref_codes, st = bnb.quantize_4bit(torch.zeros(t.shape, dtype=dtype), blocksize=64,
                                      quant_type="nf4", compress_statistics=True)
    codes, qabs, scales = q.parts(buf, t)
    st.absmax, st.state2.absmax, st.offset = qabs.clone(), scales[:-1].clone(), scales[-1].clone()
    return codes.clone().view(ref_codes.shape), st


def test_tables_are_bitsandbytes():
    assert torch.equal(NF4, bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(DYNAMIC, bnb.create_dynamic_map(signed=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_bitsandbytes(dtype):
    """Our dequantised weights equal bitsandbytes' dequantize_4bit of the same bytes, and the
    1-D tensors come back unquantised."""
    flat, q, buf = quantized(dtype)
    out = q.dequantize(buf, torch.empty(LAYOUT.numel, dtype=dtype))
    ours, orig = LAYOUT.views(out), LAYOUT.views(flat)
    for t in q.tensors:
        codes, st = bnb_state(q, buf, t, dtype)
        assert torch.equal(ours[t.name], bnb.dequantize_4bit(codes, st)), t.name
    for name in ("input_layernorm.weight", "b.bias"):
        assert torch.equal(ours[name], orig[name].to(dtype))


def test_dequantizes_bitsandbytes_quantized_weights():
    """Weights quantised by bitsandbytes (as in *-bnb-4bit checkpoints) read back the same."""
    w = torch.randn(128, 192, generator=torch.Generator().manual_seed(1)) * 0.05
    codes, st = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    lay = Layout.build([("w", (128, 192))])
    q = Nf4Layout.build(lay, torch.float32)
    buf = torch.zeros(q.nbytes, dtype=torch.uint8)
    c, qabs, scales = q.parts(buf, q.tensors[0])
    c.copy_(codes.view(-1))
    qabs.copy_(st.absmax)
    scales[:-1], scales[-1] = st.state2.absmax, st.offset
    out = q.dequantize(buf, torch.empty(lay.numel))
    assert torch.equal(out.view(128, 192), bnb.dequantize_4bit(codes, st))


def test_quantize_matches_bitsandbytes():
    """The 4-bit codes, second-level scales and offset are bitsandbytes' exactly; the 8-bit
    absmax codes are the nearest entry of the dynamic map, which bitsandbytes' CPU kernel
    misses by one entry for under 2% of blocks, so ours never reconstruct a scale worse."""
    flat, q, buf = quantized(torch.float32, seed=2)
    views = LAYOUT.views(flat)
    for t in q.tensors:
        ref_codes, st = bnb.quantize_4bit(views[t.name].clone(), blocksize=64, quant_type="nf4",
                                          compress_statistics=True)
        codes, qabs, scales = q.parts(buf, t)
        assert torch.equal(codes, ref_codes.view(-1))
        assert torch.equal(scales[:-1], st.state2.absmax) and torch.equal(scales[-1], st.offset)
        diff = (qabs.int() - st.absmax.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.02
        true = views[t.name].reshape(-1, 64).abs().amax(1)
        ours = q._absmax(t, qabs, scales)
        theirs = DYNAMIC[st.absmax.long()] * st.state2.absmax.repeat_interleave(256)[:t.blocks] + st.offset
        assert ((ours - true).abs() <= (theirs - true).abs() + 1e-9).all()


def test_error_is_that_of_4_bit_quantisation():
    """Dequantised weights are within half the widest NF4 gap of each block's scale."""
    flat, q, buf = quantized(torch.float32, seed=3)
    out = LAYOUT.views(q.dequantize(buf, torch.empty(LAYOUT.numel)))
    for t in q.tensors:
        w = LAYOUT.views(flat)[t.name].reshape(-1, 64)
        scale = w.abs().amax(1, keepdim=True)
        err = (out[t.name].reshape(-1, 64) - w).abs()
        assert (err <= 0.17 * scale + 1e-3 * scale.mean()).all()
