"""Time and memory of the LM head's chunked linear + cross-entropy: Triton vs PyTorch softmax.

Runs ``linear_ce_fwd_bwd`` (logits matmul, softmax gradient, dL/dh and dL/dW) on random bf16
data shaped like Llama-3.2-3B's head on a CUDA GPU, and prints one JSON line per (path, chunk):
median milliseconds, peak memory allocated, and the peak above the inputs and the fp32 dL/dW
buffer (the head's scratch), plus the loss so the two paths can be compared.

    python benchmarks/linear_ce_bench.py --chunks 2048 4096
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slideformer.engine.kernels.linear_ce import linear_ce_fwd_bwd  # noqa: E402


def bench(h, w, y, chunk: int, use_triton: bool, warmup: int, repeats: int) -> dict:
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)  # (V, H)
    for _ in range(warmup):  # the first Triton call compiles the kernel
        linear_ce_fwd_bwd(h, w, y, 1.0, chunk, gw, use_triton)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss, gh = linear_ce_fwd_bwd(h, w, y, 1.0, chunk, gw, use_triton)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        del gh
    peak = torch.cuda.max_memory_allocated()
    return {"path": "triton" if use_triton else "pytorch", "chunk": chunk,
            "tokens": h.shape[0], "hidden": h.shape[1], "vocab": w.shape[0],
            "ms": round(statistics.median(times), 3), "ms_min": round(min(times), 3),
            "peak_allocated_gib": round(peak / 2**30, 3),
            "head_scratch_gib": round((peak - base) / 2**30, 3), "loss": loss.item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("linear_ce_bench.py needs a CUDA GPU: the Triton path runs only on CUDA tensors, "
              "and CPU timings say nothing about it. Run it on the reference GPU machine.",
              file=sys.stderr)
        sys.exit(2)

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device="cuda", generator=g).bfloat16()  # (N, H)
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g)
         / args.hidden ** 0.5).bfloat16()  # (V, H)
    y = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    y[::7] = -100  # some untrained tokens, as in chat data
    for chunk in args.chunks:
        for use_triton in (False, True):
            print(json.dumps(bench(h, w, y, chunk, use_triton, args.warmup, args.repeats)),
                  flush=True)


if __name__ == "__main__":
    main()
