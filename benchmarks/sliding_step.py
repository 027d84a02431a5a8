"""Throughput and memory of the sliding engine on a random-init model of a SHAPES entry.

Runs on the reference GPU machine: builds the host state with random weights (no checkpoint on
disk), caps VRAM in-process to emulate a consumer card, runs warm-up and timed steps on random
tokens, and prints one JSON line per configuration: tokens/s (median), the process's CPU time
per step (for shared machines), model TFLOP/s (6 * N * tokens/s, N the active parameters of
a mixture of experts), peak VRAM allocated and
reserved, peak host RSS, CPU update params/s (from the optimizer spans of the timeline) and the
per-lane busy time of the last step. ``--device cpu --shape small`` runs on the CPU backend.

    python benchmarks/sliding_step.py --shape llama-3.2-3b --micro-batch 8 --grad-accum 1 4
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slideformer.engine.config import PreferenceConfig  # noqa: E402
from slideformer.engine.models.tiny import unit_value  # noqa: E402
from slideformer.engine.runtime.backend import make_backend  # noqa: E402
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor  # noqa: E402
from slideformer.engine.runtime.host_state import AdamHyper  # noqa: E402
from slideformer.engine.kernels.attention import take_flex_fallback  # noqa: E402
from slideformer.engine.runtime.shapes import borrowed_layers, device_items, regen_layers  # noqa: E402
from slideformer.engine.train.state import build_host_state  # noqa: E402
from slideformer.engine.train.trainer import peak_rss  # noqa: E402
from benchmarks.shapes import SHAPES, shape_config, shape_spec  # noqa: E402,F401 (one table)

@dataclass
class MB:
    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: None = None
    reference: torch.Tensor | None = None
    """A preference objective's reference log-probabilities of the rows."""


def as_pairs(mbs: list[MB]) -> list[MB]:
    """The micro-batches as preference pairs (rows 0..B/2-1 chosen, the rest rejected): the
    first half of each row is the prompt (no target), the reference log-probability that of a
    uniform model (-log V a token): the shapes and the work of a DPO step."""
    out = []
    for mb in mbs:
        labels = mb.labels.clone()
        half = labels.shape[1] // 2
        labels[:, :half] = -100
        n = (labels != -100).sum(1).float()
        out.append(MB(mb.input_ids, labels, None, -n * 11.76))
    return out


def random_batches(vocab: int, micro_batch: int, seq: int, accum: int, seed: int = 1) -> list[MB]:
    """Seeded random token ids; each label is the next token and the last position has none
    (-100): the targets Hugging Face's causal-LM loss derives from ``labels = input_ids``, so the
    engine and HF (benchmarks/side_by_side.py) train on the same micro_batch * (seq - 1) tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(accum):
        ids = torch.randint(0, vocab, (micro_batch, seq), generator=g)  # (B, T)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        out.append(MB(ids, labels))
    return out


def random_state(spec, backend, moments, layer_grads: bool = True, compute=torch.bfloat16,
                 borrowed=(), on_device=()):
    """Host state with random N(0, 0.02) weights and the tensors that scale by their values
    (norms, DeltaNet's gated norm, Gemma 4's layer and router scales) at the value that leaves
    their input unchanged (``models.tiny.unit_value``), as a model's initialisation has them
    (``lora_bench.write_random_folder``, transformers). Every item reads a window of one
    random buffer at its own offset (generating 8 B values one by one would take minutes).

    Norm weights of 0.02 shrink every layer's output and the gradients with it (a grad norm of
    0.016 on the tiny shape against 1.05 with unit norms): the steps then never clip, and an
    exact-clipping run's speculative layers always update inside the backward, where a real
    run's steps whose norm exceeds ``max_grad_norm`` update them after the barrier
    (benchmarks/RESULTS.md, 2026-12-07, ninth session).
    ``borrowed``, ``on_device``: as build_host_state's (items without a gradient buffer)."""
    host = build_host_state(spec, backend, compute, moments, layer_grads=layer_grads,
                            borrowed=borrowed, on_device=on_device)
    g = torch.Generator().manual_seed(0)
    spread = 1 << 22
    base = torch.randn(spread, generator=g) * 0.02
    longest = max(item.numel for item in host.values()) + spread
    buf = base.repeat(-(-longest // spread))
    for k, item in enumerate(host.values()):
        off = (k * 104_729) % spread
        master = buf[off:off + item.numel]
        units = [(o, math.prod(shape), one) for name, o, shape in item.layout.entries
                 if (one := unit_value(spec, name)) is not None]
        if units:
            master = master.clone()
            for o, n, one in units:
                master[o:o + n] = one
        item.set_master(master)
    return host


def residual(precision: str):
    """The executor's residual stream dtype for ``train.precision``."""
    return torch.float32 if precision == "autocast" else torch.bfloat16


def plan_shape(spec, micro_batch: int, seq: int, accum: int, clip: float, vram_gib: float,
               device: str = "cuda", precision: str = "bf16", ram_gib: float = 0.0,
               moments: str = "float32"):
    """The plan the engine's planner makes for this run: VRAM budget ``vram_gib`` (0: the GPU's
    free memory less a margin), RAM budget ``ram_gib`` (0: the machine's available RAM), its
    measured or reference hardware profile. Its exec_shape is what ``slideformer train`` would
    run with the same budgets."""
    from slideformer.engine.config import BudgetConfig
    from slideformer.engine.devices import moments_torch_dtype
    from slideformer.engine.plan import Knobs, Precision, make_plan, resolve_budgets
    from slideformer.engine.plan.targets import load_profile
    from slideformer.engine.plan.machine import gpu_memory, host_memory
    hw = load_profile("this")
    vram = f"{int(vram_gib * 2**30)}" if vram_gib else "auto"
    ram = f"{int(ram_gib * 2**30)}" if ram_gib else "auto"
    budgets = resolve_budgets(BudgetConfig(vram=vram, ram=ram), device, hw, gpu_memory(), host_memory())
    knobs = Knobs(seq_len=seq, micro_batch=micro_batch, grad_accum=accum,
                  precision=Precision(torch.bfloat16, moments_torch_dtype(moments),
                                      residual=residual(precision), fp8=precision == "fp8"),
                  clip=clip > 0, packed=False)
    return make_plan(spec, knobs, device, budgets, hw)


def planned_state(spec, args) -> tuple[list[int], list[str]]:
    """With --plan: the layers that own no host gradient buffer in every planned run
    (speculative and regenerated ones, with clipping) and the items updated on the device in
    every planned run, as ``slideformer train`` builds its state, so the host RAM is what the
    planner counted (owning them anyway would only cost memory)."""
    if not args.plan:
        return [], []
    L, common, dev = spec.num_layers, None, None
    for mb in args.micro_batch:
        for accum in args.grad_accum:
            s = plan_shape(spec, mb, args.seq, accum, args.clip, args.vram_cap,
                           device=args.device, precision=args.precision, ram_gib=args.ram,
                           moments=args.moments).exec_shape
            mine = set(borrowed_layers(s, L)) if args.clip > 0 else set()
            common = mine if common is None else common & mine
            items = set(device_items(s, L))
            dev = items if dev is None else dev & items
    return sorted(common or ()), sorted(dev or ())


def run_config(spec, host, backend, args, accum: int, shape: ExecShape | None = None) -> dict:
    """Warm-up and timed steps of one configuration; ``shape``: the executor shape (default:
    ``args.slots`` slots, ``args.checkpoints``, nothing updated on the device)."""
    shape = shape or ExecShape(micro_batch=args.micro_batch, seq_len=args.seq, n_micro=accum,
                               slots=args.slots, checkpoints=args.checkpoints,
                               head_chunk=args.head_chunk)
    ex = SlidingExecutor(spec, backend, host, shape, torch.bfloat16,
                         residual_dtype=residual(args.precision), fp8=args.precision == "fp8")
    mbs = random_batches(spec.vocab_size, args.micro_batch, args.seq, accum)
    if args.objective != "sft":
        ex.objective = (args.objective, PreferenceConfig())
        mbs = as_pairs(mbs)
    hyper = lambda coef: AdamHyper(1e-5, 0.9, 0.999, 1e-8, 0.0, 1, coef)  # noqa: E731
    times, cpu, outs = [], [], []
    backend.reset_peak()
    for k in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = ex.train_step(mbs, hyper, args.clip)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        outs.append(out)
    t0 = time.perf_counter()
    ex.drain()
    drain = time.perf_counter() - t0
    cuda = backend.is_cuda
    tokens = accum * args.micro_batch * args.seq
    med = statistics.median(times[args.warmup:])
    spans = outs[-2].timeline.resolve()
    opt = [s for s in spans if s.lane == "optimizer"]
    busy = {lane: round(sum(s.end - s.start for s in spans if s.lane == lane), 4)
            for lane in ("compute", "h2d", "d2h", "optimizer")}
    opt_params = sum(host[s.item].numel for s in opt)
    res = dict(config=args.shape, objective=args.objective, moments=args.moments,
               micro_batch=args.micro_batch,
               grad_accum=accum, seq=args.seq,
               tokens_per_step=tokens, slots=ex.k, checkpoints=shape.checkpoints,
               gpu_checkpoints=shape.gpu_checkpoints, clip=args.clip,
               precision=args.precision,
               device_update=shape.device_update, device_layers=shape.device_layers,
               vram_cap_gib=args.vram_cap, step_time_s=round(med, 4),
               step_times_s=[round(t, 4) for t in times], drain_s=round(drain, 4),
               step_cpu_s=round(statistics.median(cpu[args.warmup:]), 4),
               tokens_per_s=round(tokens / med, 1),
               model_tflops=round(6 * spec.active_params * tokens / med / 1e12, 1),
               peak_vram_alloc_gib=_gib(torch.cuda.max_memory_allocated()) if cuda else None,
               peak_vram_reserved_gib=_gib(torch.cuda.max_memory_reserved()) if cuda else None,
               peak_rss_gib=round(peak_rss() / 2**30, 2),
               cpu_update_params_per_s=round(opt_params / max(busy["optimizer"], 1e-9) / 1e9, 3),
               busy_last_step_s=busy, losses=[round(o.loss, 4) for o in outs],
               grad_norms=[round(o.grad_norm, 4) for o in outs],  # above clip: the step clipped
               # timed steps whose norm exceeded the threshold: their speculative layers updated
               # after the barrier (or were redone there), as without speculation
               clipped_steps=sum(o.grad_norm > args.clip for o in outs[args.warmup:])
               if args.clip > 0 else 0,
               spec_layers=shape.spec_layers, regen_layers=len(regen_layers(
                   spec.num_layers, shape.device_layers, shape.regen_layers)) if args.clip else 0,
               flex_fallback=take_flex_fallback())
    ex.close()
    return res


def _gib(n: int) -> float:
    return round(n / 2**30, 2)


def bench_cpu_update(n: int) -> list[dict]:
    """Our update (bf16 + remainder master) at several thread counts, the PyTorch-op fallback,
    and torch AdamW(fused) on fp32, on the same number of parameters."""
    from slideformer.engine.kernels import cpu_adam
    from slideformer.engine.models.spec import Layout
    from slideformer.engine.runtime.host_state import AdamWorkspace, HostItem, adam_update
    lay = Layout.build([("w", (n // 1024, 1024))])
    item = HostItem("x", lay, torch.bfloat16, torch.float32, lambda k, d: torch.zeros(k, dtype=d),
                    lambda k, d: torch.zeros(k, dtype=d))
    item.set_master(torch.randn(n) * 0.02)
    item.g.normal_()
    ws = AdamWorkspace()

    def timed(fn, reps=4):
        out = []
        for k in range(reps):
            t0 = time.perf_counter()
            fn(k + 1)
            out.append(time.perf_counter() - t0)
        return round(n / statistics.median(out[1:]) / 1e9, 3)

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    rows = [dict(variant="torch AdamW(fused) fp32", params_per_s=timed(lambda k: opt.step()))]
    native = cpu_adam.native_available()
    cores = torch.get_num_threads()
    for threads in sorted({8, cpu_adam.THREADS, cores, 2 * cores - 2}):
        cpu_adam.THREADS = threads
        hp = lambda k: AdamHyper(1e-4, 0.9, 0.999, 1e-8, 0.01, k, 0.5)  # noqa: E731
        rows.append(dict(variant=f"ours native={native} threads={threads}",
                         params_per_s=timed(lambda k: adam_update(item, hp(k), ws))))
    rows.append(dict(variant="ours PyTorch-op fallback", params_per_s=timed(
        lambda k: adam_update(item, AdamHyper(1e-4, 0.9, 0.999, 1e-8, 0.01, k, 0.5), ws, native=False))))
    base = rows[0]["params_per_s"]
    for r in rows:
        r.update(cpu_update_params=n, ratio_to_torch_fused=round(r["params_per_s"] / base, 3),
                 build_error=cpu_adam.BUILD_ERROR[-200:])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="llama-3.2-3b")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[8],
                    help="one run per value (ascending; stops at the first out-of-memory)")
    ap.add_argument("--grad-accum", type=int, nargs="*", default=[1, 4],
                    help="one run per value; none: only the CPU update bench")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--checkpoints", choices=["gpu", "host"], default="gpu")
    ap.add_argument("--head-chunk", type=int, default=2048)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--moments", choices=["float32", "bfloat16", "int8"], default="float32")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the CPU backend in bf16 (timings of the small shapes)")
    ap.add_argument("--precision", choices=["autocast", "bf16", "fp8"], default="bf16",
                    help="train.precision: autocast (fp32 residual stream), bf16, or fp8 (FP8 "
                         "projections; GPUs with FP8 tensor cores)")
    ap.add_argument("--vram-cap", type=float, default=24.0, help="GiB; 0 = uncapped")
    ap.add_argument("--ram", type=float, default=0.0,
                    help="with --plan: the RAM budget in GiB the planner fits the run into "
                         "(0: the machine's available RAM)")
    ap.add_argument("--objective", choices=["sft", "dpo", "simpo", "orpo"], nargs="+",
                    default=["sft"], help="one run per value: sft, or a preference objective "
                    "(--micro-batch rows are micro-batch / 2 pairs, half of each row the prompt; "
                    "tokens/s counts every row's tokens)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cpu-update", type=int, default=0, help="also bench the CPU update on N params")
    ap.add_argument("--spec-layers", type=int, default=None,
                    help="with --plan: speculative layers for exact clipping (0: the barrier; "
                         "default: the planner's)")
    ap.add_argument("--plan", action="store_true",
                    help="the planner's executor shape for each run (slots, checkpoints, device "
                         "optimizer) instead of --slots/--checkpoints")
    args = ap.parse_args()
    if args.cpu_update:
        for row in bench_cpu_update(args.cpu_update):
            print(json.dumps(row), flush=True)
    if not args.grad_accum:
        return
    backend = make_backend(args.device)
    if args.vram_cap and backend.is_cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.vram_cap * 2**30 / total)
    spec = shape_spec(args.shape)
    from slideformer.engine.devices import moments_torch_dtype
    moments = moments_torch_dtype(args.moments)  # int8: the 8-bit block format
    borrowed, on_device = planned_state(spec, args)
    host = random_state(spec, backend, moments, layer_grads=args.clip > 0,
                        borrowed=borrowed, on_device=on_device)
    print(json.dumps(dict(event="state_ready", params=spec.num_params,
                          rss_gib=round(peak_rss() / 2**30, 2))), flush=True)
    for mb, objective in [(mb, o) for mb in args.micro_batch for o in args.objective]:
        try:
            run_micro_batch(spec, host, backend, argparse.Namespace(
                **dict(vars(args), micro_batch=mb, objective=objective)))
        except torch.cuda.OutOfMemoryError as e:
            print(json.dumps(dict(event="out_of_memory", micro_batch=mb, error=str(e)[:300])), flush=True)
            break
    backend.release_host()


def run_micro_batch(spec, host, backend, args) -> None:
    for accum in args.grad_accum:
        shape = None
        if args.plan:
            plan = plan_shape(spec, args.micro_batch, args.seq, accum, args.clip, args.vram_cap,
                              device=args.device, precision=args.precision, ram_gib=args.ram,
                              moments=args.moments)
            shape = plan.exec_shape
            if args.spec_layers is not None:  # the planner's shape with another speculation depth
                shape = replace(shape, spec_layers=args.spec_layers)
            print(json.dumps(dict(event="plan", grad_accum=accum, verdict=plan.verdict,
                                  spec_layers=shape.spec_layers,
                                  predicted_tokens_per_s=round(plan.speed.tokens_per_s),
                                  predicted_clipped_tokens_per_s=None
                                  if plan.clipped_tokens_per_s is None
                                  else round(plan.clipped_tokens_per_s),
                                  predicted_bound=plan.speed.bound,
                                  predicted_vram_gib=round(plan.tier("gpu").peak / 2**30, 2),
                                  predicted_host_gib=round(plan.tier("host").peak / 2**30, 2),
                                  regen_layers=shape.regen_layers, gpu_checkpoints=shape.gpu_checkpoints,
                                  ram_budget_gib=args.ram or None)),
                  flush=True)
        print(json.dumps(run_config(spec, host, backend, args, accum, shape)), flush=True)


if __name__ == "__main__":
    main()
