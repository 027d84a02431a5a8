"""One projection in FP8 against bf16 on the GPU: where an FP8 layer's time goes.

For each (tokens, in, out) of a model's projections, times with CUDA events (milliseconds a
call, batches of 10 calls back to back, median of ``--iters`` batches after a warm-up):

- ``bf16``: ``F.linear`` forward, dL/dx and dL/dW, bf16;
- ``fp8``: ``fp8.linear`` (slideformer.engine.kernels.fp8) forward, dL/dx (row-wise e4m3) and
  dL/dW (bf16), the quantisation in the Triton kernel (kernels.triton_fp8);
- ``fp8_torch_quant``: the same with the quantisation in PyTorch ops (``fp8.rowwise_torch``);
- ``scaled_mm``: the forward's ``torch._scaled_mm`` alone, operands quantised beforehand;
- ``bf16_mm``: the forward's bf16 matmul alone;
- ``quant_triton`` / ``quant_torch``: quantising the activation (tokens, in) once.

    python benchmarks/fp8_linear.py                          # Llama-3.2-3B's projections, 8K tokens
    python benchmarks/fp8_linear.py --tokens 8192 --shapes 4096x14336,14336x4096
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from slideformer.engine.kernels import fp8

SHAPES_3B = "3072x3072,3072x1024,3072x8192,8192x3072"
"""Llama-3.2-3B's projections as in x out: q/o, k/v, gate/up, down."""


def timed(fn, iters: int, calls: int = 10) -> float:
    """Milliseconds a call of ``fn()`` takes: the median over ``iters`` batches of ``calls``
    calls back to back (the CPU launching ahead of the GPU, as in a training step; one call
    between two events would count the GPU's wait for the first launch), after three warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def one(tokens: int, k: int, n: int, iters: int) -> dict:
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, k, generator=g, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16().requires_grad_()
    gy = torch.randn(tokens, n, generator=g, device="cuda").bfloat16()

    def step(lin):
        def run():
            x.grad = w.grad = None
            lin(x, w).backward(gy)
        return run

    def torch_quantised():  # the PyTorch quantiser in the forward and in the backward
        real = fp8.rowwise
        fp8.rowwise = fp8.rowwise_torch
        try:
            step(fp8.linear)()
        finally:
            fp8.rowwise = real
    xd, wd = x.detach(), w.detach()
    (xq, sx), (wq, sw) = fp8.rowwise(xd), fp8.rowwise(wd)
    res = {"tokens": tokens, "in": k, "out": n,
           "bf16": timed(step(F.linear), iters), "fp8": timed(step(fp8.linear), iters),
           "fp8_torch_quant": timed(torch_quantised, iters),
           "scaled_mm": timed(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(),
                                                        out_dtype=torch.bfloat16), iters),
           "bf16_mm": timed(lambda: xd @ wd.t(), iters),
           "quant_triton": timed(lambda: fp8.rowwise(xd), iters),
           "quant_torch": timed(lambda: fp8.rowwise_torch(xd), iters)}
    res = {key: round(v, 4) if isinstance(v, float) else v for key, v in res.items()}
    res["fp8_over_bf16"] = round(res["bf16"] / res["fp8"], 3)
    res["mm_speedup"] = round(res["bf16_mm"] / res["scaled_mm"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shapes", default=SHAPES_3B, help="in x out, comma-separated")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    if fp8.unsupported("cuda"):
        raise SystemExit(f"fp8_linear: {fp8.unsupported('cuda')}")
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    rows = [one(a.tokens, *map(int, s.split("x")), a.iters) for s in a.shapes.split(",")]
    for r in rows:
        print(json.dumps(r))
    tot = {key: sum(r[key] for r in rows) for key in ("bf16", "fp8", "fp8_torch_quant")}
    print(json.dumps({"sum_ms": {k: round(v, 3) for k, v in tot.items()},
                      "fp8_over_bf16": round(tot["bf16"] / tot["fp8"], 3)}))


if __name__ == "__main__":
    main()
