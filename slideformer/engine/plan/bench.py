"""``slideformer bench --hardware``: measure this machine's figures for the planner, in seconds.

What it measures (each a median of a few timed repeats after a warm-up):
- GPU bf16 matmul, 8192^3 (CUDA events);
- pinned PCIe copies of 1 GiB: host->device alone, device->host alone, and both at once;
- CPU fp32 matmul, 2048^3 (the CPU backend's compute);
- CPU AdamW: slideformer.engine.runtime.host_state.adam_update on a 64M-parameter HostItem with bf16
  compute (bf16 weights + int16 remainder, fp32 moments): exactly the engine's update;
- disk: writing 1 GiB with fsync, then reading it back after dropping it from the page cache;
- GPU decoder layer (CUDA): one Llama-3.2-3B-shaped layer on 8 x 1024 tokens, its forward
  without autograd, then the recompute with autograd and the backward, exactly as the executor
  runs them (models.layers.decoder_layer, the kernels' dispatch and document masks), on every
  kernel path this machine can take (kernels.dispatch.kernel_path under each setting of
  SLIDEFORMER_TRITON / SLIDEFORMER_FLEX): its model FLOPs per second as a share of the measured
  matmul rate, which the speed model prefers to its reference figures.
Whatever cannot be measured (no GPU) keeps what slideformer.engine.plan.targets.detected assumes,
with its source (``HardwareProfile.sources``), and is named in the profile's notes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from slideformer.engine.kernels import attention, dispatch
from slideformer.engine.kernels.dispatch import kernel_path
from slideformer.engine.models.layers import decoder_layer, rope_tables
from slideformer.engine.models.recompute import layer_backward
from slideformer.engine.models.model import positions_for
from slideformer.engine.models.spec import Layout, ModelSpec, spec_from_config
from slideformer.engine.plan.hardware import HardwareProfile
from slideformer.engine.plan.machine import cpu_cores, host_memory
from slideformer.engine.plan.speed import layer_flops
from slideformer.engine.plan.targets import detected
from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, HostItem, adam_update
from slideformer.engine.runtime.shapes import ExecShape

GiB = 1 << 30


def _median_time(fn: Callable[[], None], repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    reps = 10
    t = _median_time(lambda: [a @ b for _ in range(reps)], 3, torch.cuda.synchronize)
    return 2 * n**3 * reps / t / 1e12


def pcie_gbs(nbytes: int = GiB) -> tuple[float, float, float]:
    """(host->device, device->host, each way when both run at once) in GB/s, pinned memory."""
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    sync = torch.cuda.synchronize

    def h2d():
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)

    def d2h():
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)

    up, down = _median_time(h2d, 3, sync), _median_time(d2h, 3, sync)
    both = _median_time(lambda: (h2d(), d2h()), 3, sync)
    return nbytes / up / 1e9, nbytes / down / 1e9, nbytes / both / 1e9


def cpu_matmul_tflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _median_time(lambda: a @ b, 3) / 1e12


def adam_params_per_s(numel: int = 64 << 20, native: bool | None = None) -> float:
    """The engine's CPU AdamW on a bf16-compute item (the default mixed-precision state);
    ``native=False``: through the PyTorch-op fallback."""
    layout = Layout.build([("w", (numel // 4096, 4096))])
    item = HostItem("bench", layout, torch.bfloat16, torch.float32,
                    lambda n, dt: torch.zeros(n, dtype=dt), lambda n, dt: torch.zeros(n, dtype=dt))
    item.set_master(torch.randn(layout.numel) * 0.02)
    item.g.normal_()
    ws = AdamWorkspace()
    steps = iter(range(1, 100))
    hp = lambda: AdamHyper(1e-4, 0.9, 0.999, 1e-8, 0.01, next(steps))  # noqa: E731
    return layout.numel / _median_time(lambda: adam_update(item, hp(), ws, native), 3)


def disk_gbs(folder: Path, nbytes: int = GiB) -> tuple[float, float]:
    """(read, write) GB/s of a file in ``folder``; the read bypasses the page cache."""
    block = os.urandom(16 << 20)
    fd, name = tempfile.mkstemp(prefix=".slideformer-bench-", dir=folder)
    try:
        t0 = time.perf_counter()
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0) / 1e9
        if hasattr(os, "posix_fadvise"):  # drop the file's pages so the read hits the disk
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, 16 << 20):
            pass
        read = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(name)
    return read, write


LAYER = dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
             num_hidden_layers=1, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
             rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
             torch_dtype="bfloat16")
"""The timed layer: Llama-3.2-3B's (the shape of benchmarks/layer_profile.py's figures)."""
LAYER_TOKENS = (8, 1024)
"""Its micro-batch: 8 sequences of 1024 tokens (a 3B layer's recompute needs ~1.5 GiB)."""


@contextlib.contextmanager
def kernel_switches(fused_ops: bool, flex: bool):
    """SLIDEFORMER_TRITON / SLIDEFORMER_FLEX set for one kernel choice (False: ``0``; True: the
    engine's default), restored afterwards."""
    saved = {k: os.environ.pop(k, None) for k in (dispatch.ENV, attention.ENV)}
    os.environ.update({k: "0" for k, on in ((dispatch.ENV, fused_ops), (attention.ENV, flex))
                       if not on})
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def layer_passes(spec: ModelSpec, p: dict, x: torch.Tensor, rope, mask):
    """(forward, recompute + backward) of one decoder layer as the executor runs them: the
    forward without autograd, then the layer again with autograd from the same input and the
    gradients of the input and of every parameter for a random dL/dy."""
    gy = torch.randn_like(x)
    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}

    def forward():
        with torch.no_grad():
            decoder_layer(spec, p, x, rope, mask)

    def backward():
        layer_backward(spec, leaves, x, gy, rope, mask)
    return forward, backward


def time_layer_paths(matmul_tflops: float, device: str = "cuda", log: Callable[[str], None] = print,
                     repeats: int = 5, config: dict = LAYER,
                     tokens: tuple[int, int] = LAYER_TOKENS) -> tuple[tuple[str, float], ...]:
    """(kernel path, share of ``matmul_tflops``) of one layer of ``config`` on ``tokens`` (B, T)
    through each kernel path ``device`` can take; packed rows hold documents of T/8 tokens."""
    spec, (B, T) = spec_from_config(config), tokens
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(spec.params_per_layer, generator=g) * 0.02).to(device, dtype)
    p = spec.layer_layout.views(flat)
    x = torch.randn(B, T, spec.hidden_size, generator=g).to(device, dtype)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    doc = (torch.arange(T, device=device) // (T // 8)).expand(B, T).contiguous()
    f, b = layer_flops(spec, ExecShape(micro_batch=B, seq_len=T, n_micro=1, slots=1))
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    out = []
    for key in dispatch.PATHS:
        ops, att = key.split("+")
        with kernel_switches(ops == "fused", att == "flex"):
            packed = att != "causal"
            if kernel_path(device, spec.head_dim, packed).key != key:
                continue  # not a path this machine takes (no triton, or no FlexAttention)
            mb_doc = doc if packed else None
            mask = attention.document_mask(doc, spec.head_dim) if packed else None
            rope = rope_tables(spec, positions_for(ids, mb_doc), dtype)
            fwd, bwd = layer_passes(spec, p, x, rope, mask)
            t = _median_time(lambda: (fwd(), bwd()), repeats, sync)
        share = (f + b) / t / 1e12 / matmul_tflops
        log(f"    {key}: {share:.2f} of the matmul rate ({(f + b) / t / 1e12:.0f} TFLOP/s)")
        out.append((key, round(share, 3)))
    return tuple(out)


def measure(disk_folder: Path, log: Callable[[str], None] = print) -> HardwareProfile:
    """Measure what this machine allows; the rest keeps what slideformer.engine.plan.targets.detected
    assumes (and says so)."""
    vals: dict[str, object] = {"name": platform.node() or "this machine",
                               "ram_total": host_memory().total, "cpu_cores": cpu_cores()}
    notes: list[str] = []
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        vals.update(gpu=props.name, vram_total=props.total_memory)
        vals["matmul_tflops"] = _step(log, "GPU bf16 matmul", gpu_matmul_tflops, "TFLOP/s")
        up, down, both = _step(log, "pinned PCIe copies", pcie_gbs, "GB/s")
        vals.update(h2d_gbs=up, d2h_gbs=down, duplex_gbs=both)
        B, T = LAYER_TOKENS
        log(f"  decoder layer (Llama-3.2-3B shape, {B} x {T} tokens), per kernel path:")
        try:
            vals["layer_efficiency"] = time_layer_paths(vals["matmul_tflops"], log=log)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            notes.append("decoder layer not timed (out of GPU memory): the planner keeps its "
                         "reference layer efficiencies")
    else:
        vals.update(gpu=None, vram_total=None)
        notes.append("no CUDA GPU: nothing measured on a GPU; plans here use the CPU backend")
    vals["cpu_tflops"] = _step(log, "CPU fp32 matmul", cpu_matmul_tflops, "TFLOP/s")
    vals["adam_params_per_s"] = _step(log, "CPU AdamW (adam_update, 64M params)", adam_params_per_s,
                                      "params/s")
    vals["adam_fallback_params_per_s"] = _step(
        log, "CPU AdamW fallback (PyTorch ops, 64M params)",
        lambda: adam_params_per_s(native=False), "params/s")
    try:
        read, write = _step(log, f"disk in {disk_folder}", lambda: disk_gbs(disk_folder), "GB/s")
        vals.update(disk_read_gbs=read, disk_write_gbs=write)
    except OSError as e:
        notes.append(f"disk not measured ({e}): assumed figures kept")
    measured = tuple(k for k in vals if k in _MEASURABLE)
    return dataclasses.replace(detected(), **vals, measured=measured, notes=tuple(notes))


_MEASURABLE = ("matmul_tflops", "h2d_gbs", "d2h_gbs", "duplex_gbs", "layer_efficiency",
               "cpu_tflops", "adam_params_per_s", "adam_fallback_params_per_s", "disk_read_gbs",
               "disk_write_gbs")


def _step(log, what: str, fn, unit: str):
    t0 = time.perf_counter()
    value = fn()
    shown = ", ".join(f"{v:.3g}" for v in value) if isinstance(value, tuple) else f"{value:.3g}"
    log(f"  {what}: {shown} {unit} ({time.perf_counter() - t0:.1f} s)")
    return value
