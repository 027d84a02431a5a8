"""Each kind of decoder layer of a model shape, timed alone, beside what the planner assumes.

For every distinct kind of layer of a shape (layer type and tensors: a gated DeltaNet layer,
a sliding or a full attention layer, with experts or a dense MLP), one layer of random bf16
weights (norms one; a random router spreads tokens over the experts) runs on one micro-batch
of ``B x T`` tokens, as the executor runs it:

- ``fwd``: the layer without autograd (both kinds of run);
- ``bwd_frozen``: the recompute and dL/dx only (a LoRA / QLoRA base: no weight gradient;
  the adapters' own cost is the planner's ADAPTER_BYTES term, not timed here);
- ``bwd_full``: the recompute and every parameter's gradient (models.recompute.layer_backward);
- the two halves alone (``mixer_*``: the token mixer with its norms, ``ff_*``: the MLP or the
  experts), forward and frozen backward;
- ``dequant_torch`` / ``dequant_triton``: the layer's NF4 buffer back to bf16
  (runtime.nf4.Nf4Layout.dequantize, PyTorch form and kernels.triton_nf4);

each the median of ``--reps`` runs (CUDA events), in ms. ``--profile``: also the token mixer's
forward + frozen backward under torch.profiler, its kernels with the most device time
(``mixer_kernels``: name, ms per pass, calls per pass), to see where a mixer's time goes. A ``plan`` line per shape gives the
FLOP-based per-layer averages (what the planner assumed before it timed experts and the delta
rule by measurement: plan.speed.irregular) for the same tokens (plan.speed.layer_flops / mixer_flops at the
measured 8192^3 matmul rate times the reference layer efficiency of the kernel path, and the
dequantisation at DEVICE_MEMORY_GBS) beside the measured averages over the model's layers (each
kind weighted by how many layers it has): their ratio is the planner's compute error on that
shape, before PCIe and the host enter.

    python benchmarks/family_layers.py --shape gpt-oss-120b qwen3.5-35b-a3b --micro-batch 4
    python benchmarks/family_layers.py --shape small-moe small-qwen3.5 --device cpu   # dry run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import shape_spec  # noqa: E402
from slideformer.engine.kernels import attention, dispatch  # noqa: E402
from slideformer.engine.kernels.dispatch import kernel_path  # noqa: E402
from slideformer.engine.models.inputs import LayerInputs  # noqa: E402
from slideformer.engine.models.layers import decoder_layer, ff_block, mixer_block  # noqa: E402
from slideformer.engine.models.recompute import layer_backward  # noqa: E402
from slideformer.engine.plan.bench import gpu_matmul_tflops  # noqa: E402
from slideformer.engine.plan.speed import (DEVICE_MEMORY_GBS, LAYER_EFFICIENCY,  # noqa: E402
                                           layer_flops, mixer_flops)
from slideformer.engine.runtime.nf4 import Nf4Layout  # noqa: E402
from slideformer.engine.runtime.shapes import ExecShape  # noqa: E402


def timed(fn, device: str, reps: int) -> float:
    """Median ms of ``fn`` after one warm-up run."""
    fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            import time
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(out), 3)


def random_weights(layout, device, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    flat = torch.randn(layout.numel, generator=g, device=device, dtype=dtype).mul_(0.02)
    for name, off, shape in layout.entries:
        if len(shape) == 1 and "norm" in name:
            flat[off:off + shape[0]] = 1.0
    return flat


def kinds(spec) -> dict[tuple, list[int]]:
    """{(layer type, block): the layers of that kind}."""
    out: dict[tuple, list[int]] = {}
    for i in range(spec.num_layers):
        out.setdefault((spec.layer_type(i), spec.block(i)), []).append(i)
    return out


def frozen_grad(fn, x, gy):
    """dL/dx of y = fn(x) for dL/dy = gy (the base's weights require no grad)."""
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(fn(x), x, gy)[0]


def top_kernels(fn, reps: int, n: int = 8) -> list:
    """The ``n`` kernels with the most device time over ``reps`` runs of ``fn`` (after one
    warm-up): [name (80 characters), ms per run, calls per run]."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]
    return [[e.key[:80], round(e.device_time_total / 1e3 / reps, 3), e.count // reps] for e in rows]


def layer_case(spec, i: int, B: int, T: int, device: str, dtype, reps: int, dequant: bool,
               profile: bool = False) -> dict:
    layout = spec.layout(i)
    flat = random_weights(layout, device, dtype, i)
    p = layout.views(flat)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(B, T, spec.hidden_size, generator=g, device=device, dtype=dtype)
    gy = torch.randn(B, T, spec.hidden_size, generator=g, device=device, dtype=dtype)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    make = lambda doc, w: attention.document_mask(doc, spec.max_head_dim, w)  # noqa: E731
    rope, mask = LayerInputs.of_rows(spec, ids, None, dtype, make).at(i)
    row: dict = {"layer": i, "type": spec.layer_type(i), "experts": spec.is_sparse(i),
                 "params": layout.numel}
    with torch.no_grad():
        row["fwd"] = timed(lambda: decoder_layer(spec, p, x, rope, mask), device, reps)
        m = mixer_block(spec, p, x, rope, mask)
        row["mixer_fwd"] = timed(lambda: mixer_block(spec, p, x, rope, mask), device, reps)
        row["ff_fwd"] = timed(lambda: ff_block(spec, p, m), device, reps)
    row["bwd_frozen"] = timed(lambda: frozen_grad(
        lambda v: decoder_layer(spec, p, v, rope, mask), x, gy), device, reps)
    row["mixer_bwd_frozen"] = timed(lambda: frozen_grad(
        lambda v: mixer_block(spec, p, v, rope, mask), x, gy), device, reps)
    row["ff_bwd_frozen"] = timed(lambda: frozen_grad(lambda v: ff_block(spec, p, v), m, gy),
                                 device, reps)
    if profile:
        row["mixer_kernels"] = top_kernels(lambda: frozen_grad(
            lambda v: mixer_block(spec, p, v, rope, mask), x, gy), reps)
    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
    try:
        row["bwd_full"] = timed(lambda: layer_backward(spec, leaves, x, gy, rope, mask),
                                device, reps)
    except torch.OutOfMemoryError:
        row["bwd_full"] = None  # a whole layer's gradients beside its weights
    leaves = None  # noqa: F841 (freed before the dequantisation timings)
    if dequant:
        q = Nf4Layout.build(layout, dtype)
        buf = q.quantize(flat.float() if device == "cpu" else flat,
                         torch.empty(q.nbytes, dtype=torch.uint8, device=device))
        del flat, p
        out = torch.empty(layout.numel, dtype=dtype, device=device)
        saved = os.environ.get(dispatch.ENV)
        os.environ[dispatch.ENV] = "0"
        row["dequant_torch"] = timed(lambda: q.dequantize(buf, out), device, max(2, reps // 2))
        os.environ.pop(dispatch.ENV)
        if saved is not None:  # the caller's own setting back
            os.environ[dispatch.ENV] = saved
        if dispatch.fused_ops_on(device):
            row["dequant_triton"] = timed(lambda: q.dequantize(buf, out), device, reps)
        row["nf4_bytes"] = q.nbytes
    return row


def plan_line(spec, rows: list[dict], members: list[int], B: int, T: int, device: str,
              tflops: float) -> dict:
    """The planner's per-layer figures beside the measured averages (weights: layers per kind)."""
    shape = ExecShape(micro_batch=B, seq_len=T, n_micro=1, slots=1)
    f, b = layer_flops(spec, shape)
    lin = 2.0 * spec.active_params_per_layer * B * T
    att = mixer_flops(spec, B, T)
    path = kernel_path(device, spec.max_head_dim, False)
    rate = tflops * 1e12 * LAYER_EFFICIENCY[path.key]
    P = spec.params_per_layer
    L = spec.num_layers

    def avg(key):
        vals = [(r[key], n) for r, n in zip(rows, members) if r.get(key) is not None]
        return round(sum(v * n for v, n in vals) / sum(n for _, n in vals), 3) if vals else None
    out = {"shape_plan": True, "kernel_path": path.key, "efficiency": LAYER_EFFICIENCY[path.key],
           "matmul_tflops": round(tflops, 1),
           "plan_fwd": round((lin + att) / rate * 1e3, 3),
           "plan_bwd_frozen": round((2 * lin + 3 * att) / rate * 1e3, 3),
           "plan_bwd_full": round(b / rate * 1e3, 3), "plan_fwd_full": round(f / rate * 1e3, 3)}
    nf4 = avg("nf4_bytes")
    if nf4:
        out["plan_dequant"] = round((nf4 + P * 2) / (DEVICE_MEMORY_GBS * 1e9) * 1e3, 3)
    for key in ("fwd", "bwd_frozen", "bwd_full", "dequant_torch", "dequant_triton"):
        out[f"measured_{key}"] = avg(key)
    for key in ("fwd", "bwd_frozen", "bwd_full"):
        if out[f"measured_{key}"]:
            out[f"measured_over_plan_{key}"] = round(out[f"measured_{key}"] / out[f"plan_{key}"], 2)
    out["layers"] = L
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["qwen3-30b-a3b"])
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-dequant", action="store_true", help="skip the NF4 timings")
    ap.add_argument("--profile", action="store_true",
                    help="the token mixer's kernels by device time (CUDA)")
    args = ap.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tflops = gpu_matmul_tflops() if device == "cuda" else 0.1
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "torch": torch.__version__, "matmul_tflops": round(tflops, 1),
                      "micro_batch": args.micro_batch, "seq": args.seq}), flush=True)
    for name in args.shape:
        spec = shape_spec(name)
        rows, members = [], []
        dispatch.LAUNCHES.clear()
        for (kind, _), layers in kinds(spec).items():
            row = layer_case(spec, layers[0], args.micro_batch, args.seq, device, dtype,
                             args.reps, not args.no_dequant, args.profile and device == "cuda")
            row.update(shape=name, kind=kind, count=len(layers))
            print(json.dumps(row), flush=True)
            rows.append(row)
            members.append(len(layers))
            if device == "cuda":
                torch.cuda.empty_cache()
        line = plan_line(spec, rows, members, args.micro_batch, args.seq, device, tflops)
        line.update(shape=name, launches=dict(Counter(dispatch.LAUNCHES)))
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
