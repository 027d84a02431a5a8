"""Capacity with the NVMe tier: the largest Llama-shaped model that fine-tunes under a VRAM cap
and a host-RAM budget, its step time and the disk throughput it reaches.

Measured on the reference GPU machine on 2026-11-29: benchmarks/RESULTS.md ("NVMe tier capacity").

What it does, on the reference GPU machine:
1. Size search (the planner, nothing allocated): for the width of a published Llama shape
   (hidden, intermediate, heads, vocabulary) and the run's tokens per step, the largest layer
   count L that the planner says fits ``--vram`` and ``--ram`` (default: 24 GiB and the RAM the
   machine has available less the planner's margin) -- once with all the state in RAM, once with
   the NVMe tier in ``--disk-dir`` (budget ``--nvme-size``, default its free space less 5%), where
   the planner moves the moments of the fewest layers that make host RAM fit.
2. Run (unless ``--plan-only``): that model with random weights, VRAM capped in-process, the
   plan's executor shape and disk layers (O_DIRECT where the filesystem allows), ``--warmup`` +
   ``--steps`` steps on random tokens. A run that fails (out of memory, disk full) is reported
   and the next smaller L is tried.
3. One JSON line per run: parameters, layers on disk, step time (median) and tokens/s against the
   plan's prediction, peak VRAM allocated / reserved and peak host RSS against the plan's, bytes
   the tier read and wrote per step, achieved disk GB/s (bytes moved / step time, and bytes
   moved / time the disk lane was busy), per-lane busy time of the last timed step.

    python benchmarks/nvme_capacity.py --disk-dir /path/on/nvme
    python benchmarks/nvme_capacity.py --disk-dir /tmp --ram 120GiB --nvme-size 50GiB --plan-only
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slideformer.engine.config import BudgetConfig  # noqa: E402
from slideformer.engine.models.spec import spec_from_config  # noqa: E402
from slideformer.engine.plan import REFERENCE, Knobs, Precision, make_plan, resolve_budgets  # noqa: E402
from slideformer.engine.plan.machine import gpu_memory, host_memory  # noqa: E402
from slideformer.engine.runtime.backend import make_backend  # noqa: E402
from slideformer.engine.runtime.executor import SlidingExecutor  # noqa: E402
from slideformer.engine.runtime.host_state import AdamHyper  # noqa: E402
from slideformer.engine.runtime.nvme import NvmeTier
from slideformer.engine.runtime.shapes import disk_layers  # noqa: E402
from slideformer.engine.train.state import build_host_state  # noqa: E402
from benchmarks.shapes import shape_config  # noqa: E402

GiB = 1 << 30
WIDTHS = ("llama-3.1-8b", "llama-2-13b", "llama-3.1-70b")
"""Shapes of benchmarks.shapes whose layer count the search varies."""


def make_spec(width: str, layers: int):
    return spec_from_config(dict(shape_config(width), num_hidden_layers=layers))


def largest(width: str, knobs: Knobs, budgets) -> tuple[int, object] | None:
    """(layers, plan) of the largest model of this width that fits (None: not even one layer)."""
    best = None
    for layers in range(1, 257):
        plan = make_plan(make_spec(width, layers), knobs, "cuda", budgets, REFERENCE)
        if plan.verdict == "does not fit":
            break
        best = layers, plan
    return best


@dataclass
class MB:
    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: None = None


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(spec, plan, args, moments) -> dict:
    backend = make_backend("cuda")
    folder = Path(tempfile.mkdtemp(prefix="nvme-bench-", dir=args.disk_dir))
    names = [f"layer{i}" for i in disk_layers(spec.num_layers, plan.disk_layers)]
    tier = NvmeTier(folder, names, buffers=args.buffers, threads=args.io_threads,
                    direct=not args.buffered)
    try:
        host = build_host_state(spec, backend, torch.bfloat16, moments, tier,
                                layer_grads=args.clip > 0)
        # random N(0, 0.02) weights: a window of one random buffer per item, at its own offset
        # (drawing 12 B values one by one would take minutes)
        spread = 1 << 22
        base = torch.randn(spread, generator=torch.Generator().manual_seed(0)) * 0.02
        buf = base.repeat(-(-(max(it.numel for it in host.values()) + spread) // spread))
        for k, item in enumerate(host.values()):
            off = (k * 104_729) % spread
            item.set_master(buf[off:off + item.numel])
        del buf
        shape = plan.exec_shape
        ex = SlidingExecutor(spec, backend, host, shape, torch.bfloat16)
        mbs, g = [], torch.Generator().manual_seed(1)
        for _ in range(shape.n_micro):
            ids = torch.randint(0, spec.vocab_size, (shape.micro_batch, shape.seq_len), generator=g)
            mbs.append(MB(ids, torch.roll(ids, -1, 1)))
        hyper = lambda coef: AdamHyper(1e-5, 0.9, 0.999, 1e-8, 0.0, 1, coef)  # noqa: E731
        torch.cuda.reset_peak_memory_stats()
        times, outs, moved = [], [], []
        for _ in range(args.warmup + args.steps):
            before = tier.bytes_read + tier.bytes_written
            t0 = time.perf_counter()
            outs.append(ex.train_step(mbs, hyper, args.clip))
            ex.drain()  # the step's disk writes belong to it
            times.append(time.perf_counter() - t0)
            moved.append(tier.bytes_read + tier.bytes_written - before)
        spans = outs[-1].timeline.resolve()
        busy = {lane: round(sum(s.end - s.start for s in spans if s.lane == lane), 3)
                for lane in ("compute", "h2d", "d2h", "optimizer", "disk")}
        disk_busy = _union([(s.start, s.end) for s in spans if s.lane == "disk"])
        med, per_step = statistics.median(times[args.warmup:]), statistics.median(moved[args.warmup:])
        tokens = shape.n_micro * shape.micro_batch * shape.seq_len
        ex.close()
        return dict(params=spec.num_params, layers=spec.num_layers, layers_on_disk=len(names),
                    o_direct=tier.direct, disk_file_gib=round(tier.bytes / GiB, 2),
                    vram_budget_gib=round(plan.budgets.vram / GiB, 2), slots=shape.slots,
                    checkpoints=shape.checkpoints, tokens_per_step=tokens, clip=args.clip,
                    step_time_s=round(med, 3), predicted_step_time_s=round(plan.speed.step_time, 3),
                    tokens_per_s=round(tokens / med, 1), predicted_bound=plan.speed.bound,
                    peak_vram_alloc_gib=round(torch.cuda.max_memory_allocated() / GiB, 2),
                    peak_vram_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2),
                    predicted_vram_gib=round(plan.tier("gpu").peak / GiB, 2),
                    peak_rss_gib=round(peak_rss() / GiB, 2),
                    predicted_host_gib=round(plan.tier("host").peak / GiB, 2),
                    disk_gb_per_step=round(per_step / 1e9, 2),
                    disk_gbs_over_step=round(per_step / med / 1e9, 2),
                    disk_gbs_while_busy=round(moved[-1] / max(disk_busy, 1e-9) / 1e9, 2),
                    busy_last_step_s=busy, losses=[round(o.loss, 4) for o in outs])
    finally:
        tier.close()
        backend.release_host()
        shutil.rmtree(folder, ignore_errors=True)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", choices=WIDTHS, default="llama-3.1-8b")
    ap.add_argument("--disk-dir", required=True, help="folder on the disk for the tier")
    ap.add_argument("--nvme-size", default="auto", help="disk budget (auto: free space less 5%%)")
    ap.add_argument("--vram", default="24GiB")
    ap.add_argument("--ram", default="auto", help="host RAM budget (auto: available less a margin)")
    ap.add_argument("--buffers", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--buffered", action="store_true", help="no O_DIRECT")
    ap.add_argument("--moments", default="float32")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--plan-only", action="store_true", help="only the size search")
    args = ap.parse_args()
    moments = torch.bfloat16 if args.moments == "bfloat16" else torch.float32
    knobs = Knobs(seq_len=args.seq, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                  precision=Precision(torch.bfloat16, moments), clip=args.clip > 0, packed=False)
    cfg = BudgetConfig(vram=args.vram, ram=args.ram, nvme_dir=args.disk_dir, nvme_size=args.nvme_size)
    with_disk = resolve_budgets(cfg, "cuda", REFERENCE, gpu_memory(), host_memory())
    ram_only = resolve_budgets(BudgetConfig(vram=args.vram, ram=args.ram), "cuda", REFERENCE,
                               gpu_memory(), host_memory())
    found = {}
    for name, budgets in (("ram_only", ram_only), ("with_tier", with_disk)):
        found[name] = largest(args.width, knobs, budgets)
        row = dict(event="size_search", placement=name, width=args.width,
                   vram_gib=round(budgets.vram / GiB, 1), ram_gib=round(budgets.ram / GiB, 1),
                   disk_gib=round(budgets.disk / GiB, 1), layers=None)
        if found[name]:
            layers, plan = found[name]
            row.update(layers=layers, params=plan.total_params, layers_on_disk=plan.disk_layers,
                       verdict=plan.verdict, predicted_tokens_per_s=round(plan.speed.tokens_per_s),
                       predicted_bound=plan.speed.bound)
        print(json.dumps(row), flush=True)
    if args.plan_only or found["with_tier"] is None:
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(with_disk.vram / total)
    layers = found["with_tier"][0]
    while layers > 0:
        spec = make_spec(args.width, layers)
        plan = make_plan(spec, knobs, "cuda", with_disk, REFERENCE)
        try:
            print(json.dumps(run(spec, plan, args, moments)), flush=True)
            return
        except (torch.cuda.OutOfMemoryError, OSError, MemoryError) as e:
            print(json.dumps(dict(event="failed", layers=layers, error=str(e)[:300])), flush=True)
            torch.cuda.empty_cache()
            layers -= 1



if __name__ == "__main__":
    main()
