"""Capacity with the NVMe tier: the largest Llama-shaped model that fine-tunes under a VRAM cap
and a host-RAM budget, its step time and the disk throughput it reaches.

NOT RUN YET. This program has not been run on the reference GPU machine; no figure from it is in
benchmarks/RESULTS.md. Until it has run there, the sizes below are arithmetic, not measurements.

What it does, on the reference GPU machine:
1. Size search (arithmetic only, engine.runtime.nvme.tier_bytes): for the width of a published
   Llama shape (hidden, intermediate, heads, vocabulary), the largest layer count L for which the
   host state fits ``--ram`` less ``--ram-reserve`` (runtime, activations, page tables) with some
   fraction of the layers' moments on disk (nvme_fraction), and those moments fit ``--nvme-size``
   (default: the free space of ``--disk-dir`` less 2 GiB). Printed for RAM only and with the tier.
2. Run (unless ``--plan-only``): that model with random weights, VRAM capped in-process at
   ``--vram-cap`` GiB, the chosen layers' moments in the tier (O_DIRECT where the filesystem
   allows), ``--warmup`` + ``--steps`` steps on random tokens. If a run fails (out of memory,
   disk full), the next smaller L is tried.
3. One JSON line per run: parameters, layers on disk, step time (median), tokens/s, peak VRAM
   allocated / reserved, peak host RSS, bytes read and written per step, achieved disk GB/s
   (bytes moved / step time, and bytes moved / time the disk lane was busy), per-lane busy time
   of the last timed step.

    python benchmarks/nvme_capacity.py --disk-dir /path/on/nvme --ram 128GiB --vram-cap 24

What the size search says (``--plan-only``, arithmetic, not a measurement): every item keeps its
bf16 weights, remainder and fp32 gradient in RAM (8 bytes/param), so at 128 GiB less 10 GiB the
Llama-3.1-8B width reaches 31 layers (7.8 G params) in RAM alone, 59 layers (13.9 G) with every
layer's moments on disk, 78 (18.1 G) with the remainders there too; with a 50 GiB disk budget,
44 layers (10.6 G). The run is what checks that these sizes train under the VRAM cap, and at what
speed.
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

from engine.config import parse_bytes  # noqa: E402
from engine.models.spec import spec_from_config  # noqa: E402
from engine.runtime.backend import make_backend  # noqa: E402
from engine.runtime.executor import ExecShape, SlidingExecutor  # noqa: E402
from engine.runtime.host_state import AdamHyper  # noqa: E402
from engine.runtime.nvme import NvmeTier, disk_layers, nvme_fraction, tier_bytes  # noqa: E402
from engine.train.state import build_host_state  # noqa: E402

GiB = 1 << 30
WIDTHS = {  # published config.json values; the layer count is what the search varies
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         head_dim=128),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000, tie_word_embeddings=False,
                        head_dim=128),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                          head_dim=128),
}


def make_spec(width: str, layers: int):
    cfg = dict(WIDTHS[width], num_hidden_layers=layers, model_type="llama", rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=131072, torch_dtype="bfloat16")
    return spec_from_config(cfg)


def largest(width: str, ram: int, disk: int, moments, remainders: bool, buffers: int,
            tier: bool) -> tuple[int, float] | None:
    """(layers, fraction on disk) of the largest model of this width that fits (None: none)."""
    best = None
    for layers in range(1, 257):
        spec = make_spec(width, layers)
        if not tier:
            ram_need, _ = tier_bytes(spec, 0, torch.bfloat16, moments)
            fits = (layers, 0.0) if ram_need <= ram else None
        else:
            f = nvme_fraction(spec, ram, torch.bfloat16, moments, remainders=remainders,
                              buffers=buffers)
            n = len(disk_layers(layers, f)) if f is not None else None
            fits = None if n is None or tier_bytes(spec, n, torch.bfloat16, moments, remainders,
                                                   buffers)[1] > disk else (layers, f)
        if fits is None and best is not None:
            break
        best = fits or best
    return best


@dataclass
class MB:
    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: None = None


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(spec, fraction: float, args, moments) -> dict:
    backend = make_backend("cuda")
    folder = Path(tempfile.mkdtemp(prefix="nvme-bench-", dir=args.disk_dir))
    names = [f"layer{i}" for i in disk_layers(spec.num_layers, fraction)]
    tier = NvmeTier(folder, names, remainders=args.remainders, buffers=args.buffers,
                    threads=args.io_threads, direct=not args.buffered)
    try:
        host = build_host_state(spec, backend, torch.bfloat16, moments, tier)
        g = torch.Generator().manual_seed(0)
        buf = torch.empty(max(it.numel for it in host.values()))
        for item in host.values():
            item.set_master(buf[:item.numel].normal_(0.0, 0.02, generator=g))
        del buf
        shape = ExecShape(micro_batch=args.micro_batch, seq_len=args.seq, n_micro=args.grad_accum,
                          slots=args.slots, checkpoints=args.checkpoints, head_chunk=args.head_chunk)
        ex = SlidingExecutor(spec, backend, host, shape, torch.bfloat16)
        mbs = []
        for _ in range(args.grad_accum):
            ids = torch.randint(0, spec.vocab_size, (args.micro_batch, args.seq), generator=g)
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
        tokens = args.grad_accum * args.micro_batch * args.seq
        ex.close()
        return dict(params=spec.num_params, layers=spec.num_layers, layers_on_disk=len(names),
                    remainders_on_disk=args.remainders, o_direct=tier.direct,
                    disk_file_gib=round(tier.bytes / GiB, 2), vram_cap_gib=args.vram_cap,
                    tokens_per_step=tokens, clip=args.clip, step_time_s=round(med, 3),
                    tokens_per_s=round(tokens / med, 1),
                    peak_vram_alloc_gib=round(torch.cuda.max_memory_allocated() / GiB, 2),
                    peak_vram_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2),
                    peak_rss_gib=round(peak_rss() / GiB, 2),
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
    ap.add_argument("--nvme-size", default="", help="disk budget; default: free space - 2 GiB")
    ap.add_argument("--ram", default="128GiB")
    ap.add_argument("--ram-reserve", default="10GiB",
                    help="RAM kept out of the host state: runtime, activations, OS")
    ap.add_argument("--remainders", action="store_true", help="remainders on disk too")
    ap.add_argument("--buffers", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--buffered", action="store_true", help="no O_DIRECT")
    ap.add_argument("--moments", default="float32")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--checkpoints", choices=["gpu", "host"], default="gpu")
    ap.add_argument("--head-chunk", type=int, default=2048)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--vram-cap", type=float, default=24.0, help="GiB")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--plan-only", action="store_true", help="only the size search")
    args = ap.parse_args()
    moments = torch.bfloat16 if args.moments == "bfloat16" else torch.float32
    ram = parse_bytes(args.ram, "--ram") - parse_bytes(args.ram_reserve, "--ram-reserve")
    disk = (parse_bytes(args.nvme_size, "--nvme-size") if args.nvme_size
            else shutil.disk_usage(args.disk_dir).free - 2 * GiB)
    ram_only = largest(args.width, ram, disk, moments, args.remainders, args.buffers, tier=False)
    with_tier = largest(args.width, ram, disk, moments, args.remainders, args.buffers, tier=True)
    for name, found in (("ram_only", ram_only), ("with_tier", with_tier)):
        spec = make_spec(args.width, found[0]) if found else None
        print(json.dumps(dict(event="size_search", placement=name, width=args.width,
                              ram_for_state_gib=round(ram / GiB, 1), disk_gib=round(disk / GiB, 1),
                              layers=found and found[0], fraction_on_disk=found and found[1],
                              params=spec and spec.num_params)), flush=True)
    if args.plan_only or with_tier is None:
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(args.vram_cap * GiB / total)
    layers = with_tier[0]
    while layers > 0:
        spec = make_spec(args.width, layers)
        fraction = nvme_fraction(spec, ram, torch.bfloat16, moments, remainders=args.remainders,
                                 buffers=args.buffers) or 0.0
        try:
            print(json.dumps(run(spec, fraction, args, moments)), flush=True)
            return
        except (torch.cuda.OutOfMemoryError, OSError, MemoryError) as e:
            print(json.dumps(dict(event="failed", layers=layers, error=str(e)[:300])), flush=True)
            torch.cuda.empty_cache()
            layers -= 1


if __name__ == "__main__":
    main()
