"""Several GPUs of one host: tokens/s and host memory of 1 vs N GPUs at the same tokens per GPU.

Runs the engine's own data-parallel path (slideformer.engine.dist: one process per GPU over one
host state in shared memory, gradients all-reduced over NCCL, each rank updating 1/N of every
item) on a random-init model of a public shape, each GPU capped in-process
(``torch.cuda.set_per_process_memory_fraction``) to emulate a consumer card. Each configuration
runs in a fresh child process; the parent samples the memory of the child's process tree:
the sum of PSS (shared pages divided among the processes that map them: the true footprint of
one shared host state) and the sum of RSS (shared pages counted once per process). Prints one
JSON line per configuration and a Markdown table.

    python benchmarks/multi_gpu.py --shape llama-3.2-3b llama-3.1-8b --gpus 1 2 \\
        --vram-cap 24 --seq 1024 --micro-batch 8 --accum-per-gpu 4
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sliding_step import SHAPES, random_batches, random_state, shape_spec  # noqa: E402

from slideformer.engine import config as config_mod  # noqa: E402
from slideformer.engine.dist.ranks import host_alloc, rank_shape, start_ranks  # noqa: E402
from slideformer.engine.runtime.backend import make_backend  # noqa: E402
from slideformer.engine.runtime.executor import SlidingExecutor  # noqa: E402
from slideformer.engine.runtime.host_state import AdamHyper  # noqa: E402

GiB = 1 << 30
CAP_GIB = [24.0]
"""Each rank's VRAM cap (set by the child from its arguments before any rank starts)."""


def cap_memory(rank: int) -> None:
    """Cap this process's GPU at CAP_GIB (rank 0 here; ranks 1.. through start_ranks)."""
    total = torch.cuda.get_device_properties(rank).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB[0] * GiB / total), rank)


def child(a) -> None:
    """One configuration: N ranks, warm-up and timed steps; prints one JSON line."""
    CAP_GIB[0] = a.vram_cap
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        cap_memory(0)
    spec = shape_spec(a.shape[0])
    n, accum = a.gpus[0], a.accum_per_gpu * a.gpus[0]
    folder = Path(tempfile.mkdtemp(prefix="multi-gpu-"))  # config.json only: the ranks' spec
    (folder / "config.json").write_text(json.dumps(spec.raw_config))
    cfg = config_mod.from_dict({"model": {"path": str(folder)},
                                "optim": {"max_grad_norm": a.clip},
                                "train": {"micro_batch": a.micro_batch, "grad_accum": accum,
                                          "gpus": n}})
    from sliding_step import plan_shape
    shape = rank_shape(plan_shape(spec, a.micro_batch, a.seq, accum, a.clip, a.vram_cap,
                                  a.device).exec_shape, n)
    backend = make_backend("cuda:0" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    host = random_state(spec, host_alloc(backend, n), torch.float32, layer_grads=a.clip > 0,
                        compute=dtype)
    ranks = start_ranks(cfg, host, shape, dtype, n, cuda, cap_memory if cuda else None)
    ex = SlidingExecutor(spec, backend, host, shape, dtype, group=ranks.group)
    mbs = random_batches(spec.vocab_size, a.micro_batch, a.seq, accum)
    times = []
    for k in range(a.warmup + a.steps):
        hp = AdamHyper(1e-5, 0.9, 0.999, 1e-8, 0.0, k + 1, 1.0)
        ranks.start_step(mbs, hp)
        t0 = time.perf_counter()
        out = ex.train_step(mbs, lambda coef, hp=hp: dataclasses.replace(hp, grad_scale=coef),
                            a.clip, timeline=False)
        times.append(time.perf_counter() - t0)
    tokens = accum * a.micro_batch * a.seq
    med = statistics.median(times[a.warmup:])
    print(json.dumps(dict(shape=a.shape[0], gpus=n, micro_batch=a.micro_batch, seq=a.seq,
                          accum_per_gpu=a.accum_per_gpu, tokens_per_step=tokens,
                          tokens_per_gpu_per_step=tokens // n, clip=a.clip,
                          vram_cap_gib=a.vram_cap, slots=ex.k, checkpoints=shape.checkpoints,
                          step_time_s=round(med, 4), step_times_s=[round(t, 4) for t in times],
                          tokens_per_s=round(tokens / med, 1), last_loss=round(out.loss, 4),
                          peak_vram_reserved_gib_rank0=round(torch.cuda.max_memory_reserved(0)
                                                             / GiB, 2) if cuda else None)),
          flush=True)
    ex.close()
    ranks.close()


def tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(sum of PSS, sum of RSS) of a process and its descendants, in bytes."""
    pss = rss = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            info = p.memory_full_info()
            pss, rss = pss + info.pss, rss + info.rss
        except psutil.Error:
            pass
    return pss, rss


def run_one(a, shape: str, gpus: int) -> dict:
    argv = [sys.executable, __file__, "--child", "--shape", shape, "--gpus", str(gpus),
            "--vram-cap", str(a.vram_cap), "--seq", str(a.seq), "--micro-batch",
            str(a.micro_batch), "--accum-per-gpu", str(a.accum_per_gpu), "--clip", str(a.clip),
            "--warmup", str(a.warmup), "--steps", str(a.steps), "--device", a.device]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    peak = [0, 0]

    def sample() -> None:
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            pss, rss = tree_memory(ps)
            peak[0], peak[1] = max(peak[0], pss), max(peak[1], rss)
            time.sleep(0.5)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    watcher.join()
    if proc.returncode:
        return dict(shape=shape, gpus=gpus, error=f"exit code {proc.returncode}")
    rec = json.loads(out.strip().splitlines()[-1])
    rec.update(peak_pss_tree_gib=round(peak[0] / GiB, 2), peak_rss_tree_gib=round(peak[1] / GiB, 2))
    return rec


def table(records: list[dict]) -> str:
    lines = ["| shape | GPUs | tokens/step (per GPU) | tokens/s | vs 1 GPU | host PSS GiB | vs 1 GPU "
             "| host RSS sum GiB | VRAM GiB (rank 0) |", "|---|---|---|---|---|---|---|---|---|"]
    base = {r["shape"]: r for r in records if r.get("gpus") == 1 and "error" not in r}
    for r in records:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['gpus']} | {r['error']} | | | | | | |")
            continue
        b = base.get(r["shape"])
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else ""
        mem = f"{r['peak_pss_tree_gib'] / b['peak_pss_tree_gib']:.2f}x" if b else ""
        lines.append(f"| {r['shape']} | {r['gpus']} | {r['tokens_per_step']:,} "
                     f"({r['tokens_per_gpu_per_step']:,}) | {r['tokens_per_s']:,.0f} | {speed} | "
                     f"{r['peak_pss_tree_gib']} | {mem} | {r['peak_rss_tree_gib']} | "
                     f"{r['peak_vram_reserved_gib_rank0']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", choices=SHAPES, default=["llama-3.2-3b", "llama-3.1-8b"])
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--vram-cap", type=float, default=24.0, help="GiB per GPU")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum-per-gpu", type=int, default=4, help="micro-batches per GPU per step")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the code path (gloo, --shape tiny)")
    ap.add_argument("--out", help="write the records (JSON lines) here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    records = []
    for shape in a.shape:
        for gpus in a.gpus:
            records.append(run_one(a, shape, gpus))
            print(json.dumps(records[-1]), flush=True)
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(table(records))


if __name__ == "__main__":
    main()
