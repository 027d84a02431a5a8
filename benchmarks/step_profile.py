"""Where one sliding step's GPU time goes (the reference GPU machine), Llama-3.2-3B shape, seq 1024,
micro-batch 8, exact clipping 1.0, the planner's executor shape under a 24 GiB cap.

    python benchmarks/step_profile.py gaps ACCUM [SPEC_LAYERS|plan] [LABEL]
        tok/s of 7 steps and, for the 6th, the compute stream's idle gaps between the
        executor's spans (our timeline), the phase marks and the CPU optimizer's spans
    python benchmarks/step_profile.py kernels ACCUM
        one step under torch.profiler: kernel time by category, the union of kernel time
    python benchmarks/step_profile.py head
        the LM head's dL/dW accumulation variants (bf16 row blocks + fp32 add, fp32-output
        addmm) and a layer projection's weight gradient, timed alone

Without CUDA ``gaps`` runs the tiny shape on the CPU backend (a dry run). Results:
benchmarks/RESULTS.md, 2026-12-02 (second session).
"""
import collections
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sliding_step import make_backend, plan_shape, random_batches, random_state, shape_spec  # noqa: E402

from slideformer.engine.runtime.executor import SlidingExecutor  # noqa: E402
from slideformer.engine.runtime.host_state import AdamHyper  # noqa: E402
from slideformer.engine.runtime.shapes import borrowed_layers, device_items  # noqa: E402


def p(**kw):
    print(json.dumps(kw), flush=True)

def timed(fn, reps=5):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    out = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); out.append(s.elapsed_time(e))
    return round(sorted(out)[len(out) // 2], 3)

def head_variants():
    V, H = 128256, 3072
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
    gw = torch.zeros(V, H, device="cuda")
    for n in (2048, 4096, 8192):
        h = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
        dz = torch.randn(n, V, device="cuda", dtype=torch.bfloat16)
        def cur():
            for r in range(0, V, 8192):
                gw[r:r + 8192] += (dz[:, r:r + 8192].t() @ h).float()
        def whole_bf16():
            gw.add_(dz.t() @ h)
        res = dict(tokens=n, logits_mm=timed(lambda: h @ w.t()), gh_mm=timed(lambda: dz @ w),
                   gw_current=timed(cur), gw_whole_bf16=timed(whole_bf16))
        try:
            def dtype_addmm():
                torch.addmm(gw, dz.t(), h, out_dtype=torch.float32, out=gw)
            res["gw_addmm_out_dtype_inplace"] = timed(dtype_addmm)
            ref = gw.clone(); gw.zero_(); dtype_addmm(); a = gw.clone(); gw.zero_(); cur()
            res["addmm_vs_current_maxdiff"] = float((a - gw).abs().max())
            res["addmm_vs_fp32_maxdiff"] = float((a - (dz.float().t() @ h.float())).abs().max())
            res["current_vs_fp32_maxdiff"] = float((gw - (dz.float().t() @ h.float())).abs().max())
        except Exception as e:
            res["addmm_error"] = str(e)[:300]
        try:
            def mm_dtype():
                gw.add_(torch.mm(dz.t(), h, out_dtype=torch.float32))
            res["gw_mm_out_dtype_add"] = timed(mm_dtype)
        except Exception as e:
            res["mm_error"] = str(e)[:300]
        p(event="head_variants", **res)
        del h, dz
    g = torch.zeros(100_000_000, device="cuda")
    gp = torch.randn(100_000_000, device="cuda", dtype=torch.bfloat16)
    p(event="grad_add_100M", ms=timed(lambda: g.add_(gp)))
    # layer weight grad: go^T @ x with out_dtype into fp32 vs bf16 then add
    N, I = 8192, 8192
    go = torch.randn(N, I, device="cuda", dtype=torch.bfloat16); x = torch.randn(N, 3072, device="cuda", dtype=torch.bfloat16)
    gv = torch.zeros(I, 3072, device="cuda")
    r = dict(bf16_then_add=timed(lambda: gv.add_(go.t() @ x)), bf16_only=timed(lambda: go.t() @ x))
    try:
        r["addmm_out_dtype"] = timed(lambda: torch.addmm(gv, go.t(), x, out_dtype=torch.float32, out=gv))
    except Exception as e:
        r["error"] = str(e)[:200]
    p(event="weight_grad_8192x8192x3072", **r)
    del w, gw, g, gp, go, x, gv
    torch.cuda.empty_cache()

def category(name):
    n = name.lower()
    if "memcpy" in n or "memset" in n: return "memcpy/memset"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "sm90", "cublas")): return "matmul"
    if "flash" in n or "fmha" in n or "attention" in n: return "attention"
    if "triton" in n or n.startswith("_"): return "triton:" + name[:60]
    if "reduce" in n or "norm" in n: return "reduce"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n or "fill" in n or "copy" in n: return "elementwise"
    return "other"

def kernels(accum, mb=8, cap=24.0):
    backend = make_backend("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
    spec = shape_spec("llama-3.2-3b")
    plan = plan_shape(spec, mb, 1024, accum, 1.0, cap)
    s = plan.exec_shape
    L = spec.num_layers
    host = random_state(spec, backend, torch.float32, layer_grads=True,
                        borrowed=borrowed_layers(s, L), on_device=device_items(s, L))
    ex = SlidingExecutor(spec, backend, host, s, torch.bfloat16)
    mbs = random_batches(spec.vocab_size, mb, 1024, accum)
    hyper = lambda c: AdamHyper(1e-5, 0.9, 0.999, 1e-8, 0.0, 1, c)
    for _ in range(3):
        t0 = time.perf_counter(); out = ex.train_step(mbs, hyper, 1.0); torch.cuda.synchronize()
        p(event="warm", accum=accum, s=round(time.perf_counter() - t0, 3))
    from torch.profiler import profile as prof, ProfilerActivity
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as pr:
        t0 = time.perf_counter(); out = ex.train_step(mbs, hyper, 1.0); torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    cats = collections.Counter(); names = collections.Counter(); counts = collections.Counter()
    kern = [e for e in pr.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in kern:
        d = e.device_time if hasattr(e, "device_time") else e.cuda_time
        cats[category(e.name)] += d; names[e.name[:90]] += d; counts[e.name[:90]] += 1
    compute = [e for e in kern if "memcpy" not in e.name.lower()]
    iv = sorted((e.time_range.start, e.time_range.end) for e in compute)
    union, cur = 0, None
    for a, b in iv:
        if cur is None or a > cur[1]:
            if cur: union += cur[1] - cur[0]
            cur = [a, b]
        else: cur[1] = max(cur[1], b)
    if cur: union += cur[1] - cur[0]
    p(event="profile", accum=accum, shape=str(s), wall_s=round(wall, 4), predicted=round(plan.speed.tokens_per_s),
      tok_s=round(accum * mb * 1024 / wall), kernel_union_s=round(union / 1e6, 4),
      categories={k: round(v / 1e6, 4) for k, v in cats.most_common()})
    p(event="top_kernels", accum=accum, top=[[k, round(v / 1e3, 2), counts[k]] for k, v in names.most_common(40)])
    ex.close(); backend.release_host()



def gaps(accum: int, spec_layers: str = "plan", label: str = "") -> None:
    CUDA = torch.cuda.is_available()
    backend = make_backend("cuda" if CUDA else "cpu")
    if CUDA:
        torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    spec = shape_spec("llama-3.2-3b" if CUDA else "tiny"); L = spec.num_layers
    SEQ = 1024 if CUDA else 64
    plan = plan_shape(spec, 8, SEQ, accum, 1.0, 24.0, device="cuda" if CUDA else "cpu")
    s = plan.exec_shape if spec_layers == "plan" else replace(plan.exec_shape, spec_layers=int(spec_layers))
    host = random_state(spec, backend, torch.float32, layer_grads=True,
                        borrowed=borrowed_layers(s, L), on_device=device_items(s, L))
    ex = SlidingExecutor(spec, backend, host, s, torch.bfloat16)
    marks = []
    for name in ("forward_window", "head_step", "backward_window", "_barrier_updates"):
        f = getattr(ex, name)
        def wrap(*a, _f=f, _n=name, **k):
            marks.append((_n + ">", backend.mark())); r = _f(*a, **k); marks.append((_n + "<", backend.mark())); return r
        setattr(ex, name, wrap)
    mbs = random_batches(spec.vocab_size, 8, SEQ, accum)
    hyper = lambda c: AdamHyper(1e-5, 0.9, 0.999, 1e-8, 0.0, 1, c)
    times, outs = [], []
    for k in range(7):
        marks.clear()
        t0 = time.perf_counter(); out = ex.train_step(mbs, hyper, 1.0); times.append(time.perf_counter() - t0); outs.append(out)
        if k == 5:
            tl = out.timeline
            phase = [(n, tl._t(m)) for n, m in marks]
    ex.drain()
    med = statistics.median(times[2:])
    spans = [sp for sp in outs[5].timeline.resolve() if sp.lane == "compute"]
    spans.sort(key=lambda sp: sp.start)
    gaps, end, prev = [], 0.0, "start"
    for sp in spans:
        if sp.start - end > 2e-4:
            gaps.append((round((sp.start - end) * 1e3, 2), prev, sp.item, round(end, 4)))
        if sp.end > end:
            end, prev = sp.end, sp.item
    busy = sum(sp.end - sp.start for sp in spans)
    head = [round((sp.end - sp.start) * 1e3, 1) for sp in spans if sp.item == "head"]
    opt = [sp for sp in outs[5].timeline.resolve() if sp.lane == "optimizer"]
    print(json.dumps(dict(label=label, accum=accum, shape=str(s), tok_s=round(accum * 8 * SEQ / med), step_s=round(med, 4),
                          step6_s=round(times[5], 4), predicted=round(plan.speed.tokens_per_s), compute_busy_s=round(busy, 4),
                          last_compute_end_s=round(end, 4), head_ms=head, gap_total_ms=round(sum(g[0] for g in gaps), 1),
                          phases=[(n, round(t, 4)) for n, t in phase],
                          optimizer=[(o.item, round(o.start, 3), round(o.end, 3)) for o in opt],
                          gaps=sorted(gaps, reverse=True)[:25],
                          peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if CUDA else None,
                          peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if CUDA else None)), flush=True)
    ex.close(); backend.release_host()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "head":
        head_variants()
    elif what == "kernels":
        kernels(int(sys.argv[2]))
    else:
        gaps(int(sys.argv[2]), *sys.argv[3:5])
