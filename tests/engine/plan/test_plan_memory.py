"""The planner's byte counts against the engine's real allocations (CPU).

Persistent buffers must match the tensors the host state and the executor allocate, byte for
byte; the transient terms must match the peak of live tensors that PyTorch's allocator reports
while the executor's own functions run (profiler memory events), over shapes that exercise
every term (GQA, biases, QK-norm, packing masks, bf16, several LM-head chunks).
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from slideformer.engine.kernels.attention import packed_causal_mask
from slideformer.engine.kernels.linear_ce import linear_ce_fwd_bwd
from slideformer.engine.models.layers import decoder_layer, rms_norm, rope_tables
from slideformer.engine.models.model import positions_for
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config
from slideformer.engine.plan import memory as M
from slideformer.engine.plan import transients as TR
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.shapes import (QCHUNK, QCHUNK_TEMP, device_items, regen_layers,
                                               speculative_layers)
from slideformer.engine.train.state import build_host_state

MiB = 1 << 20
F32 = torch.float32


def _spec(arch="llama", **kw):
    return spec_from_config(tiny_config(arch, TinyShape(**kw)))


def _rows(allocs, *purposes) -> int:
    found = [a for a in allocs if a.purpose in purposes]
    assert found, purposes
    return sum(a.bytes for a in found)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("compute,moments,ckpt,clip,dev,spec_n,res,regen", [
    (torch.float32, torch.float32, "gpu", True, 0, 0, None, 0), (torch.bfloat16, torch.bfloat16, "host", True, 2, 2, None, 2),
    (torch.bfloat16, torch.float32, "gpu", True, 0, 3, None, 1), (torch.bfloat16, torch.float32, "gpu", False, 1, 0, None, 2),
    (torch.float32, torch.float32, "gpu", True, 1, 9, None, 4), (torch.bfloat16, torch.float32, "gpu", False, 0, 2, None, 0),
    (torch.bfloat16, torch.float32, "host", True, 1, 2, F32, 0), (torch.bfloat16, torch.float32, "gpu", True, 0, 0, F32, 5),
    (torch.bfloat16, torch.float32, "gpu", True, 0, 0, None, 9),
    (torch.float32, torch.int8, "gpu", True, 1, 2, None, 0), (torch.bfloat16, torch.int8, "host", False, 2, 0, None, 2)])
def test_persistent_buffers_match_the_engine(compute, moments, ckpt, clip, dev, spec_n, res, regen):
    spec = _spec("qwen2", layers=5, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=200, tie=True)
    shape = ExecShape(micro_batch=3, seq_len=10, n_micro=2, slots=3, checkpoints=ckpt,
                      device_update=bool(dev), device_layers=dev, spec_layers=spec_n,
                      regen_layers=regen)
    backend = CpuBackend()
    regenerated = regen_layers(5, dev, regen)
    host = build_host_state(spec, backend, compute, moments, layer_grads=clip,
                            borrowed=speculative_layers(5, dev, spec_n, regenerated) + regenerated,
                            on_device=device_items(shape, 5))
    ex = SlidingExecutor(spec, backend, host, shape, compute, residual_dtype=res)
    allocs = M.allocations(spec, shape, M.Precision(compute, moments, residual=res), "cpu",
                           packed=True, clip=clip)
    items = host.values()
    name = str(compute).removeprefix("torch.")
    assert _rows(allocs, f"{name} weights") == _nbytes(*(i.w for i in items))
    assert _rows(allocs, "AdamW moments m, v") == _nbytes(*(t for i in items for t in (i.m, i.v)))
    snap_g = [s.g for s in ex.snapshots.snaps.values()]
    assert _rows(allocs, "gradient buffers") == _nbytes(*(i.g for i in items), *ex.ring.bufs, *snap_g)
    assert bool(ex.ring.bufs) == (not clip or bool(regen))
    snaps = [a for a in allocs if a.purpose == "speculative update snapshots"]
    assert sum(a.bytes for a in snaps) == _nbytes(*ex.snapshots.buffers()) - _nbytes(*snap_g)
    assert len(ex.snapshots.snaps) == min(spec_n, 5 - dev - len(regenerated))
    rem = [a for a in allocs if a.purpose == "weight remainders"]
    assert sum(a.bytes for a in rem) == _nbytes(*(i.rem for i in items))
    assert _rows(allocs, "parameter slots") == _nbytes(*(s.buf for s in ex.pool.slots))
    assert _rows(allocs, "embedding weights", "head weights") == _nbytes(ex.embed_w, ex.head_w)
    assert _rows(allocs, "embedding grads", "head grads") == _nbytes(ex.embed_g, ex.head_g)
    assert _rows(allocs, "gradient slots") == _nbytes(*ex.gslots)
    if dev:
        resident = {id(t) for t in (ex.embed_w, ex.embed_g, ex.head_w, ex.head_g)}
        state = [t for it in ex.dev.values() for t in (it.w, it.rem, it.m, it.v, it.g)
                 if t is not None and id(t) not in resident]
        assert _rows(allocs, "embedding and head optimizer state", "device layers") == _nbytes(*state)
        ws = ex.dev_ws
        temps = QCHUNK_TEMP * QCHUNK if moments == torch.int8 else 0  # 8-bit: the requantise's
        assert _rows(allocs, "device optimizer scratch") == _nbytes(ws.p, ws.m, ws.v) + temps
        assert len(ex.dev) == 2 + dev
    if res is not None:
        assert _rows(allocs, "norm weight remainders") == _nbytes(*ex.norms.rem.values())
        assert _rows(allocs, "norm remainder staging") == _nbytes(*ex.norms.staging.values())
    if ckpt == "host":
        assert _rows(allocs, "checkpoint staging") == _nbytes(ex.store.staging)
        assert _rows(allocs, "pinned activation checkpoints") == _nbytes(ex.store.host)
    else:
        assert _rows(allocs, "activation checkpoints") == _nbytes(ex.store.buf)
    ex.close()


def _peak_live(fn) -> int:
    """Peak bytes of live tensors PyTorch allocated while ``fn`` ran (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = top = 0
    for _, n in events:
        live += n
        top = max(top, live)
    return top


CASES = [  # (arch, shape, B, T, dtype, packed, head_chunk[, residual dtype])
    ("llama", dict(hidden=256, heads=4, kv_heads=4, intermediate=688), 4, 128, torch.float32, False, 4096),
    ("llama", dict(hidden=256, heads=8, kv_heads=2, intermediate=512), 2, 96, torch.bfloat16, False, 4096),
    ("qwen2", dict(hidden=192, heads=6, kv_heads=2, intermediate=500), 3, 100, torch.float32, True, 4096),
    ("qwen3", dict(hidden=128, heads=4, kv_heads=2, intermediate=384, head_dim=48), 2, 128,
     torch.bfloat16, False, 4096),
    ("mistral", dict(hidden=128, heads=4, kv_heads=4, intermediate=344), 2, 256, torch.float32, False, 128),
    # train.precision = "autocast": an fp32 residual stream under bf16 compute
    ("llama", dict(hidden=256, heads=8, kv_heads=2, intermediate=512), 2, 96, torch.bfloat16, False, 4096, F32),
    ("llama", dict(hidden=256, heads=4, kv_heads=4, intermediate=688), 4, 128, torch.bfloat16, False, 4096, F32),
    ("qwen2", dict(hidden=192, heads=6, kv_heads=2, intermediate=500), 3, 100, torch.bfloat16, True, 4096, F32),
    ("qwen3", dict(hidden=128, heads=4, kv_heads=2, intermediate=384, head_dim=48), 2, 128,
     torch.bfloat16, False, 4096, F32),
    ("mistral", dict(hidden=128, heads=4, kv_heads=4, intermediate=344), 2, 256, torch.bfloat16, False, 128, F32),
]


@pytest.mark.parametrize("arch,kw,B,T,dt,packed,chunk,res", [c + (None,) * (8 - len(c)) for c in CASES])
def test_transients_match_allocator_peaks(arch, kw, B, T, dt, packed, chunk, res):
    check_transients(arch, kw, B, T, dt, packed, chunk, res)


UNDER = pytest.mark.xfail(strict=True, reason="the PyTorch-op forward's attention in 16-bit with "
                          "grouped KV heads, a boolean mask or QK-norm peaks 0.4-1.7 MiB above "
                          "the model at these sizes (15-45%): not modelled yet")


@pytest.mark.parametrize("arch,kw,B,T,dt,packed,tile,res", [
    ("llama", dict(hidden=128, heads=4, kv_heads=2, intermediate=688), 1, 1024, torch.float32, False, 128, None),
    ("llama", dict(hidden=128, heads=4, kv_heads=4, intermediate=688), 2, 512, torch.bfloat16, False, 100, None),
    pytest.param("llama", dict(hidden=128, heads=4, kv_heads=2, intermediate=688), 1, 1024,
                 torch.bfloat16, False, 256, None, marks=UNDER),
    pytest.param("llama", dict(hidden=128, heads=4, kv_heads=2, intermediate=688), 1, 1024,
                 torch.bfloat16, True, 256, None, marks=UNDER),
    pytest.param("qwen3", dict(hidden=128, heads=4, kv_heads=2, intermediate=512, head_dim=48), 2,
                 512, torch.bfloat16, False, 200, F32, marks=UNDER)])
def test_tiled_feed_forward_transients_match_allocator_peaks(arch, kw, B, T, dt, packed, tile, res,
                                                             monkeypatch):
    """A long sequence with its feed-forward in tiles (ExecShape.ff_tokens) and its attention
    whole (the layers that cannot tile their queries: models.recompute.query_tiles): the forward's
    and the recompute's peaks as predicted (the intermediate width 5.4x the hidden: the untiled
    recompute peaks are 3-4x these). Where tiles leave the peak to attention, the PyTorch-op
    path's attention is modelled for fp32 and for 16-bit without grouped KV heads only."""
    from slideformer.engine.models import recompute
    monkeypatch.setattr(recompute, "query_tiles", lambda *a, **k: False)
    check_transients(arch, kw, B, T, dt, packed, 4096, res, tile)


@pytest.mark.parametrize("arch,kw,T,tile", [
    ("llama", dict(hidden=512, heads=8, kv_heads=2, intermediate=1376), 2048, 256),
    ("llama", dict(hidden=512, heads=8, kv_heads=2, intermediate=1376), 4096, 256),
    ("llama", dict(hidden=1024, heads=8, kv_heads=2, intermediate=2816, head_dim=128), 8192, 1024)])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_query_tiled_transients_match_allocator_peaks(arch, kw, T, tile, dt):
    """The layer in tiles of queries (models.recompute.query_tiled_grads), one sequence a step:
    the recompute's peak within 8% (-4% to +7% on these; on the CPU each tile's rows of the
    causal mask over every key count; grouped KV heads of 4:1)."""
    check_transients(arch, kw, 1, T, dt, False, 4096, None, tile, queries="mask",
                     parts=("backward",), tol=0.08)


def test_query_tiles_plan_no_more_than_the_feed_forward_tiles_would():
    """Where a model tiles its queries the plan's recompute is below the feed-forward-only
    plan's, and the planner and the layers agree on which models do (sinks, fused
    projections, windows shorter than the rows, FlexAttention's BlockMask: not)."""
    from slideformer.engine.kernels.dispatch import KernelPath
    from slideformer.engine.models.recompute import query_tiles
    flash = KernelPath(True, True, "causal")
    spec = _spec("llama", layers=1, vocab=4000, hidden=1024, heads=8, kv_heads=2,
                 intermediate=2816, head_dim=128)
    prec = M.Precision(torch.bfloat16, torch.float32)
    N = 65536

    def recompute(queries):
        return sum(a.bytes for a in TR.fused_recompute_scratch(spec, N, 1, N, prec, False,
                                                               tile=4096, queries=queries))
    assert recompute("flash") < 0.6 * recompute("")
    for arch, window in (("llama", None), ("gpt_oss", None), ("phi3", None), ("mistral", 4096),
                         ("mistral", 1 << 20), ("gemma3_text", 512)):
        sp = spec_from_config(dict(tiny_config(arch, TinyShape(layers=2)), sliding_window=window))
        lay = {k: v for k, v in sp.layout(0).views(torch.zeros(sp.layout(0).numel)).items()}
        x = torch.zeros(1, 8192, sp.hidden_size)
        mask = None if window is None or window >= 8192 else torch.ones(8192, 8192, dtype=torch.bool)
        planned = TR.query_tiled(sp, flash, 8192)
        runs = query_tiles(sp, lay, x, mask, 4096)
        assert planned == runs or (runs and not planned), (arch, window)  # the plan may err high
    assert not TR.query_tiled(spec, KernelPath(True, True, "flex"), 8192)


def check_transients(arch, kw, B, T, dt, packed, chunk, res, tile=0, queries="",
                     parts=("forward", "head", "backward"), tol=0.06):
    torch.manual_seed(0)
    spec = _spec(arch, layers=1, vocab=4000, **kw)
    prec, N, res = M.Precision(dt, torch.float32, residual=res), B * T, res or dt
    w = (0.02 * torch.randn(spec.params_per_layer)).to(dt)
    ids = torch.randint(0, spec.vocab_size, (B, T))
    doc = (torch.arange(T) >= T // 3).long().expand(B, T).clone() if packed else None
    rope = rope_tables(spec, positions_for(ids, doc), res)
    mask = None if doc is None else packed_causal_mask(doc)
    x, gy = torch.randn(B, T, spec.hidden_size).to(res), torch.randn(B, T, spec.hidden_size).to(res)
    holder = type("Holder", (), {"spec": spec, "lora": None, "aux": (), "ff_tile": tile,
                                 "fp8": False,
                                 "_norm_views": lambda self, n, p: p})()
    head_w = (0.02 * torch.randn(spec.vocab_size, spec.hidden_size)).to(dt)
    norm_w = torch.ones(spec.hidden_size, dtype=dt)
    head_g = torch.zeros(spec.vocab_size, spec.hidden_size)
    slot_g = torch.zeros(w.numel())

    def forward():
        with torch.no_grad():
            decoder_layer(spec, spec.layer_layout.views(w), x, rope, mask, tile=tile)

    def head():  # as SlidingExecutor.head_step does for one micro-batch
        xx, nw = x.detach().requires_grad_(), norm_w.detach().requires_grad_()
        with torch.enable_grad():
            h = rms_norm(xx, nw, spec.rms_norm_eps, dt)
        _, gh = linear_ce_fwd_bwd(h.detach(), head_w, ids, 1.0, chunk, head_g)
        torch.autograd.grad(h, [xx, nw], gh)

    def backward():
        SlidingExecutor._layer_backward(holder, w, slot_g, x, gy, rope, mask)

    shape = ExecShape(B, T, 1, 1, head_chunk=chunk)
    predicted = {"forward": TR.forward_scratch(spec, N, B, T, prec, packed, tile).bytes,
                 "head": TR.head_scratch(spec, shape, prec).bytes,
                 "backward": sum(a.bytes for a in TR.recompute_scratch(spec, N, B, T, prec, packed,
                                                                       tile=tile, queries=queries))}
    for part, fn in (("forward", forward), ("head", head), ("backward", backward)):
        if part not in parts:
            continue
        measured = _peak_live(fn)
        # 6%, or a quarter MiB for the smallest terms (kernel-internal buffers of a few KB)
        assert abs(predicted[part] - measured) <= max(tol * measured, MiB / 4), (
            f"{part}: predicted {predicted[part] / MiB:.2f} MiB, measured {measured / MiB:.2f} MiB")


def test_peaks_follow_the_phases():
    """Loading and training do not overlap: the peak is the larger of the two, not the sum."""
    a = M.Allocation
    allocs = [a("host", "state", 100, "", "state"), a("host", "load", 30, "", "setup"),
              a("host", "exec", 20, "", "run"),
              a("host", "fwd", 5, "", "forward"), a("host", "bwd", 8, "", "backward")]
    assert M.peak(allocs, ("host",)) == 130
    assert M.peak([x for x in allocs if x.phase != "setup"], ("host",)) == 128
    assert M.peak_phase(allocs, ("host",)) == "setup"


def test_fused_cross_entropy_needs_only_the_logits():
    """With the Triton kernel the LM-head chunk holds its logits once (overwritten by dL/dz)
    instead of the fp32 copies of the PyTorch path."""
    spec = _spec("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=1000, tie=False)
    shape = ExecShape(micro_batch=2, seq_len=64, n_micro=1, slots=2, head_chunk=128)
    prec = M.Precision(torch.bfloat16, torch.float32)
    torch_path = TR.head_scratch(spec, shape, prec, fused_ce=False).bytes
    fused = TR.head_scratch(spec, shape, prec, fused_ce=True).bytes
    softmax = 128 * 1000 * (4 + 4 + 2)  # fp32 logits, fp32 softmax-grad, its bf16 copy
    wgrad = 128 * 1000 * 2 + 1000 * 64 * (2 + 4)  # dz next to one row block and its upcast
    assert torch_path - fused == softmax - wgrad  # fused: the logits alone never dominate


def test_math_path_attention_scores_match_allocator_peaks():
    """Heads wider than SDPA's fused kernels take (Gemma 4's full layers, 512) run its math
    path on CUDA, which forms the scores: the planner's bytes per score against the allocator
    peak of that path (forced here on the CPU), forward alone and forward + backward."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from slideformer.engine.kernels.dispatch import KernelPath
    spec = spec_from_config(dict(tiny_config("gemma4_text", TinyShape(layers=4)),
                                 num_attention_heads=2, global_head_dim=512))
    B, T = 1, 4096
    q = torch.randn(B, 2, T, 512, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, 1, T, 512, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")

    def forward():
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def both():
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(o, [q, k, v], torch.ones_like(o))
    predicted = TR.math_scores(spec, B, T, KernelPath(True, True, "causal"))
    assert predicted == TR.MATH_SCORE_BYTES * B * 2 * T * T
    for fn in (forward, both):
        measured = _peak_live(fn)
        assert abs(predicted - measured) <= 0.06 * measured, (fn.__name__, predicted, measured)
    cpu = KernelPath(False, False, "causal", cuda=False)  # the CPU's flash kernel takes any head
    assert TR.math_scores(spec, B, T, cpu) == 0
    narrow = spec_from_config(tiny_config("llama", TinyShape(layers=2)))
    assert TR.math_scores(narrow, B, T, KernelPath(True, True, "causal")) == 0
