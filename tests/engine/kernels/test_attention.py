"""Packed-document attention: the FlexAttention BlockMask against the boolean-mask SDPA.

On the CPU the engine keeps the boolean mask (FlexAttention has no CPU backward), so the CPU
test checks only the BlockMask's rule through FlexAttention's uncompiled forward; the ``gpu``
tests compare the compiled FlexAttention with SDPA on the boolean mask, forward and gradients,
for packed documents whose boundaries fall inside and on the 128-token blocks.
"""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from slideformer.engine.kernels import attention, dispatch
from slideformer.engine.kernels.attention import (attend, document_block_mask, document_mask,
                                                  flex_available, packed_causal_mask)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def documents(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """Document ids (B, T): row 0 one document, the others cut at random lengths (1 to T/2),
    including one-token documents and a cut on a block boundary."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(T, dtype=torch.long)]
    for _ in range(B - 1):
        cuts = torch.randint(1, max(T // 2, 2), (T,), generator=g).cumsum(0)
        cuts = torch.cat([cuts[cuts < T], torch.tensor([min(128, T - 1), T - 1])]).unique()
        row = torch.zeros(T, dtype=torch.long)
        row[cuts] = 1
        rows.append(row.cumsum(0))
    return torch.stack(rows)


def qkv(B, nh, nkv, T, hd, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, hd, generator=g).to(device, dtype) for n in (nh, nkv, nkv)]


def test_block_mask_rule_matches_the_boolean_mask_on_cpu():
    doc = documents(3, 300)
    q, k, v = qkv(3, 4, 2, 300, 16, torch.float32, "cpu")
    from torch.nn.attention.flex_attention import flex_attention
    with warnings.catch_warnings():  # uncompiled FlexAttention warns that it is the slow path
        warnings.simplefilter("ignore")
        got = flex_attention(q, k, v, block_mask=document_block_mask(doc), enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_causal_mask(doc), enable_gqa=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cpu_keeps_the_boolean_mask_and_sdpa(monkeypatch):
    monkeypatch.setattr(dispatch, "LAUNCHES", Counter())
    doc = documents(2, 40)
    mask = document_mask(doc, 16)
    assert not flex_available("cpu", 16)
    assert torch.equal(mask, packed_causal_mask(doc))
    q, k, v = qkv(2, 4, 2, 40, 16, torch.float32, "cpu")
    out = attend(q, k, v, mask, False, True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    assert not dispatch.LAUNCHES


def test_flex_wants_a_power_of_two_head_dim(monkeypatch):
    monkeypatch.delenv(attention.ENV, raising=False)
    assert not flex_available("cuda", 80) and not flex_available("cuda", 8)
    monkeypatch.setenv(attention.ENV, "0")
    assert not flex_available("cuda", 128)
    monkeypatch.delenv(attention.ENV)
    assert not flex_available("cuda", 512)  # beyond any GPU's shared memory (Gemma 4's full heads)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mask_shape", ["rows", "2d"])
def test_decode_attention_equals_sdpa_without_copying_kv(mask_shape, device):
    """One new token per row, grouped KV heads, a boolean mask with gaps (GRPO's rows of
    different prompt lengths): decode_attention, which folds the query heads of a KV head into
    one matmul's rows, equals SDPA's (math path) output."""
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, S, hd = 3, 8, 2, 11, 16
    q = torch.randn(B, nh, 1, hd, generator=g)
    k, v = (torch.randn(B, nkv, S, hd, generator=g) for _ in range(2))
    if mask_shape == "rows":
        lens = torch.tensor([2, 7, 5])[:, None]
        slot = torch.arange(S)[None]
        mask = ((slot < lens) | (slot >= 8))[:, None, None]  # (B, 1, 1, S)
    else:
        mask = torch.arange(S)[None] >= 3  # (1, S): a window
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        q, k, v, mask = (t.cuda() for t in (q, k, v, mask))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = attention.decode_attention(q, k, v, mask, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attend(q, k, v, mask, False, True), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("smem,limit", [(232448, 256), (101376, 128), (0, 256)])
def test_flex_head_limit_follows_the_gpus_shared_memory(monkeypatch, smem, limit):
    """Heads of 256 only where a block has ~227 KiB of shared memory (H100-class); ~100 KiB
    cards (RTX 40xx) keep FlexAttention to heads of 128; unknown: 256."""
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(shared_memory_per_block_optin=smem))
    assert attention.flex_max_head_dim("cuda") == limit
    assert attention.flex_max_head_dim("cpu") == 256


# ---- GPU ----------------------------------------------------------------------------------------
def grads(fn, inputs, gy):
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = fn(*leaves)
    return [y, *torch.autograd.grad(y, leaves, gy)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("B,nh,nkv,T,hd", [(4, 8, 8, 256, 64), (3, 24, 8, 1024, 128),
                                           (2, 4, 2, 300, 128), (1, 2, 1, 1, 64)])
def test_flex_matches_boolean_mask_sdpa(B, nh, nkv, T, hd, monkeypatch):
    """Forward and dq, dk, dv in bf16 within bf16 rounding of the SDPA reference (the
    difference was measured at 0.0078 on a Llama-3.2-3B layer)."""
    monkeypatch.setattr(dispatch, "LAUNCHES", Counter())
    monkeypatch.delenv(attention.ENV, raising=False)
    doc = documents(B, T, seed=T).cuda()
    mask = document_mask(doc, hd)
    assert not isinstance(mask, torch.Tensor), "CUDA should take FlexAttention"
    q, k, v = qkv(B, nh, nkv, T, hd, torch.bfloat16, "cuda")
    gy = torch.randn(B, nh, T, hd, device="cuda", dtype=torch.bfloat16)
    got = grads(lambda a, b, c: attend(a, b, c, mask, False, nh != nkv), [q, k, v], gy)
    assert dispatch.LAUNCHES["flex_attention"] == 1
    bool_mask = packed_causal_mask(doc)
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=bool_mask, enable_gqa=nh != nkv), [q, k, v], gy)
    exact = grads(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=bool_mask, enable_gqa=nh != nkv), [q.float(), k.float(), v.float()],
        gy.float())
    # One key per query (T = 1): the exact dq and dk vanish (softmax over one key is constant);
    # what a bf16 kernel leaves is the rounding of D = rowsum(dO * O) times k or q, about
    # sqrt(hd) * 2^-8 * |dO| |v| |k| with random signs, taken twice as the scale of such a zero.
    vanished = 2 ** -7 * hd ** 0.5 * (gy.abs().max() * v.abs().max()
                                      * torch.stack([q.abs().max(), k.abs().max()]).max()).item()
    for g, r, e, name in zip(got, ref, exact, ("out", "dq", "dk", "dv")):
        top = e.abs().max().item()
        err, err_ref = (g.float() - e).abs().max().item(), (r.float() - e).abs().max().item()
        if T == 1 and name in ("dq", "dk"):
            assert err <= vanished, f"{name}: flex {err:.3g} where the exact value is 0"
            continue
        assert err <= 2e-2 * top, f"{name}: flex vs fp32 SDPA {err:.3g} (max |ref| {top:.3g})"
        assert err <= 2 * err_ref + 2 ** -8 * top, (
            f"{name}: flex error {err:.3g} vs bf16 SDPA's {err_ref:.3g}")


@pytest.mark.gpu
@cuda
def test_one_block_mask_serves_every_layer_without_recompiling(monkeypatch):
    """The executor builds a mask per micro-batch and reuses it across layers; masks of new
    micro-batches of the same shape must reuse the compiled kernel."""
    from torch._dynamo.utils import counters
    monkeypatch.delenv(attention.ENV, raising=False)
    q, k, v = qkv(2, 8, 8, 512, 64, torch.bfloat16, "cuda")
    attend(q, k, v, document_mask(documents(2, 512, 1).cuda(), 64), False, False)
    before = dict(counters["stats"])
    for seed in range(2, 5):
        mask = document_mask(documents(2, 512, seed).cuda(), 64)
        for _ in range(3):
            attend(q, k, v, mask, False, False)
    assert dict(counters["stats"]).get("unique_graphs") == before.get("unique_graphs")


@pytest.mark.gpu
@cuda
def test_plain_causal_rows_stay_on_sdpa(monkeypatch):
    monkeypatch.setattr(dispatch, "LAUNCHES", Counter())
    q, k, v = qkv(2, 4, 4, 128, 64, torch.bfloat16, "cuda")
    out = attend(q, k, v, None, True, False)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert not dispatch.LAUNCHES


@pytest.mark.gpu
@cuda
def test_decoder_layer_on_packed_documents_matches_the_boolean_mask(monkeypatch):
    """A Llama-3.2-3B-shaped layer as the executor runs it on a packed micro-batch: with the
    BlockMask of document_mask and with the boolean mask (SLIDEFORMER_FLEX=0), forward and
    input gradient within bf16 rounding."""
    from slideformer.engine.models import layers
    from slideformer.engine.models.model import positions_for
    from slideformer.engine.models.spec import spec_from_config
    spec = spec_from_config(dict(
        model_type="llama", vocab_size=32, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=1, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        torch_dtype="bfloat16"))
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(spec.params_per_layer, generator=g) * 0.02).to("cuda", torch.bfloat16)
    p = spec.layer_layout.views(flat)
    doc = documents(4, 1024, seed=7).cuda()
    ids = torch.zeros_like(doc)
    rope = layers.rope_tables(spec, positions_for(ids, doc), torch.bfloat16)
    x = torch.randn(4, 1024, 3072, generator=g).to("cuda", torch.bfloat16)
    gy = torch.randn(4, 1024, 3072, generator=g).to("cuda", torch.bfloat16)

    def run():
        mask = document_mask(doc, spec.head_dim)
        return grads(lambda xi: layers.decoder_layer(spec, p, xi, rope, mask), [x], gy), mask
    monkeypatch.delenv(attention.ENV, raising=False)
    (flex_y, flex_dx), flex_mask = run()
    monkeypatch.setenv(attention.ENV, "0")
    (ref_y, ref_dx), ref_mask = run()
    assert not isinstance(flex_mask, torch.Tensor) and isinstance(ref_mask, torch.Tensor)
    for a, b, name in ((flex_y, ref_y, "y"), (flex_dx, ref_dx, "dx")):
        err, top = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
        assert err <= 2e-2 * top, f"{name}: flex vs boolean mask {err:.3g} (max |ref| {top:.3g})"


def _limit_hit(*args, **kwargs):
    import torch._dynamo.exc as exc
    flag, _ = attention._limit_flag()
    assert getattr(torch._dynamo.config, flag), "the compiled call must run with the flag set"
    raise exc.FailOnRecompileLimitHit("recompile_limit reached")


def test_past_the_recompile_limit_flex_runs_uncompiled_and_says_so_once(monkeypatch):
    """Dynamo falls back silently past its recompile limit; attend takes the same uncompiled
    path, gives the same result, and leaves one notice for the trainer."""
    monkeypatch.setattr(attention, "_flex", lambda: _limit_hit)
    monkeypatch.setattr(attention, "_FALLBACK", {"seen": False, "notice": None})
    doc = documents(2, 256)
    mask = document_block_mask(doc)
    q, k, v = qkv(2, 4, 2, 256, 16, torch.float32, "cpu")
    got = attend(q, k, v, mask, False, True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_causal_mask(doc),
                                         enable_gqa=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    notice = attention.take_flex_fallback()
    assert notice and "recompile limit" in notice and "uncompiled" in notice
    assert attention.take_flex_fallback() is None
    attend(q, k, v, mask, False, True)
    assert attention.take_flex_fallback() is None, "one notice per process"


@pytest.mark.gpu
@cuda
def test_real_recompile_limit_hit_is_caught(monkeypatch):
    """On CUDA with dynamo's own limit set to one compile: a second head shape hits it, and
    the call still answers (uncompiled) with a notice."""
    import torch._dynamo
    monkeypatch.delenv(attention.ENV, raising=False)
    monkeypatch.setattr(attention, "_FALLBACK", {"seen": False, "notice": None})
    attention._flex()  # compiled once per process; it raises the limit, lowered here
    torch._dynamo.reset()
    flag, _ = attention._limit_flag()
    name = "recompile_limit" if flag == "fail_on_recompile_limit_hit" else "cache_size_limit"
    monkeypatch.setattr(torch._dynamo.config, name, 1)
    outs = []
    for hd in (32, 64, 128):
        doc = documents(2, 256, hd).cuda()
        q, k, v = qkv(2, 4, 4, 256, hd, torch.bfloat16, "cuda")
        got = attend(q, k, v, document_mask(doc, hd), False, False)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=packed_causal_mask(doc))
        outs.append((got.float() - ref.float()).abs().max().item())
    torch._dynamo.reset()
    assert max(outs) < 2e-2, outs
    assert "recompile limit" in (attention.take_flex_fallback() or "")


def _qkv(device, dtype, B=2, nh=4, nkv=2, T=40, hd=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, n, T, hd, generator=g) * 0.5).to(device, dtype).requires_grad_()
            for n in (nh, nkv, nkv)]


@pytest.mark.parametrize("causal", [True, False])
def test_tf32_attention_graph_gives_sdpa_grads(causal):
    """The wide-head wrapper's own graph (forward kept, differentiated in its backward) returns
    SDPA's output and gradients, in q, k, v order, None where an input needs none (CPU: TF32
    changes nothing here, so they are equal)."""
    q, k, v = _qkv("cpu", torch.float32, T=12, hd=16)
    k.requires_grad_(False)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    rq, rv = torch.autograd.grad(ref, (q, v), g)
    out = attention._TF32Attention.apply(q, k, v, None, causal, True, None)
    assert torch.equal(out, ref)
    dq, dv = torch.autograd.grad(out, (q, v), g)  # k's None: autograd accepts no other
    assert torch.equal(dq, rq) and torch.equal(dv, rv)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_heads_on_tf32_as_close_to_fp32_as_the_math_path(dtype):
    """Heads of 512 (Gemma 4's full layers) through attend: output and gradients within the
    math path's own distance from the fp32 reference (x1.5 + a rounding step), and the TF32
    flag restored after forward and backward."""
    q, k, v = _qkv("cuda", dtype)
    g = torch.randn(q.shape, device="cuda", dtype=dtype)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    rgrads = torch.autograd.grad(r, ref, g.double())
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        m = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mgrads = torch.autograd.grad(m, (q, k, v), g)
    before = torch.backends.cuda.matmul.allow_tf32
    out = attend(q, k, v, None, True, True)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    eps = torch.finfo(dtype).eps
    for got, math, want in zip((out, *grads), (m, *mgrads), (r, *rgrads)):
        d_math = (math.double() - want).abs().max().item()
        d_ours = (got.double() - want).abs().max().item()
        assert d_ours <= 1.5 * d_math + eps * want.abs().max().item(), (d_ours, d_math)


def test_tf32_flag_is_on_in_the_wide_forward_and_backward_and_restored(monkeypatch):
    """The math path's matmuls see TF32 on in the forward (SDPA) and in the backward (the inner
    graph's autograd.grad), and the flag is back as it was after each."""
    seen = []
    sdpa, grad = F.scaled_dot_product_attention, torch.autograd.grad

    def spy_sdpa(*a, **k):
        seen.append(("sdpa", torch.backends.cuda.matmul.allow_tf32))
        return sdpa(*a, **k)

    def spy_grad(*a, **k):
        seen.append(("grad", torch.backends.cuda.matmul.allow_tf32))
        return grad(*a, **k)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy_sdpa)
    q, k, v = _qkv("cpu", torch.float32, T=8, hd=16)
    before = torch.backends.cuda.matmul.allow_tf32
    out = attention.wide_attention(q, k, v, None, True, True, None)
    assert seen == [("sdpa", True)] and torch.backends.cuda.matmul.allow_tf32 == before
    monkeypatch.setattr(torch.autograd, "grad", spy_grad)
    out.sum().backward()  # the outer backward is not autograd.grad: only the inner call is seen
    assert seen[1:] == [("grad", True)] and torch.backends.cuda.matmul.allow_tf32 == before
    assert q.grad is not None and k.grad is not None and v.grad is not None
    with torch.no_grad():  # no graph wanted: SDPA under the flag, no Function
        attention.wide_attention(q, k, v, None, True, True, None)
    assert seen[-1] == ("sdpa", True)


def test_tf32_context_keeps_to_the_newer_precision_setting(monkeypatch):
    """Where the process set ``fp32_precision`` so that PyTorch refuses to read the older
    ``allow_tf32``, the context sets and restores the newer setting instead."""
    m = torch.backends.cuda.matmul
    old = m.fp32_precision
    try:
        m.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):  # the older flag is unreadable now
            m.allow_tf32  # noqa: B018
        writes = []
        real = type(m).__setattr__
        monkeypatch.setattr(type(m), "__setattr__",
                            lambda self, k, v: (writes.append((k, v)), real(self, k, v))[1])
        with attention.tf32_matmuls():
            assert m.fp32_precision == "tf32"
        assert writes == [("fp32_precision", "tf32"), ("fp32_precision", "tf32")]
    finally:
        monkeypatch.undo()
        m.fp32_precision = old
    m.allow_tf32  # noqa: B018  (the process is back on the older flag: readable)
