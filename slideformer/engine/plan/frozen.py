"""Memory and speed of frozen-base runs (train.method = lora / qlora).

Memory mirrors slideformer.engine.runtime.lora and the executor's frozen path:
  host   the base: every item in the compute dtype (lora), or the decoder layers in NF4
         (slideformer.engine.runtime.nf4.Nf4Layout bytes) and the embedding and head unquantised (qlora);
         the adapters' host copy (weights, remainder, m, v: what checkpoints read)
  gpu    K slots of one layer's base bytes; with NF4 one dequantised layer (the scratch) and
         the dequantisation's temporaries; the resident embedding and head weights (no
         gradients); every adapter with its master, moments and fp32 gradient (DeviceItem);
         the activation checkpoints and the step's transients as for full training, except that
         the recompute's parameter grads are the adapters' only
Speed: each layer crosses PCIe as its base bytes, in the forward for the layers not resident
from the previous step and again in the backward; the backward computes input gradients only
(2 P N in the recompute, 2 P N for dL/dx: no weight-gradient GEMM), the head 4 N V H (no dL/dW);
NF4 layers are dequantised twice per step at the device's memory bandwidth (the Triton kernel's
traffic; :data:`NF4_TORCH_FACTOR` times that on the PyTorch form); each adapter adds
:data:`ADAPTER_BYTES` of device traffic per element of its input and output, per token and per
pass (forward, recompute, backward); the adapters are updated on the device after the backward.
No CPU optimizer, no gradient traffic.

NVMe tier (``disk_layers``, slideformer.engine.runtime.lora.BaseReader): the base of that many
decoder layers (slideformer.engine.runtime.shapes.disk_layers says which) lives in files instead of
host RAM: the host keeps the rest, plus the tier's staging buffers (written while loading, so
held from then on); the disk holds one padded file per layer. A step reads each disk layer
once per window that loads it (:func:`base_reads`) at the disk's read rate; the reads run
ahead of the loads, so they add a stage to each window's load/compute pipeline (the disk's
share per streamed layer), as the full-training disk term does. Nothing is written back.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from slideformer.engine.models.lora import PROJECTIONS, LoraSpec, adapter_layout, adapter_params
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.plan.hardware import HardwareProfile
from slideformer.engine.plan.memory import (RUNTIME_WORKING, Allocation, Precision,
                                allocator_reserve, checkpoint_store, cuda_fixed,
                                device_optimizer_scratch, read_scratch, runtime_baseline)
from slideformer.engine.plan.transients import FrozenBase, step_transients
from slideformer.engine.plan.speed import (CPU_COPY_GBS, DEVICE_ADAM_BYTES, DEVICE_MEMORY_GBS,
                               HEAD_EFFICIENCY, SERIAL, SpeedEstimate, _pipeline, _result,
                               cpu_dispatch_s, fp8_saving, irregular, kernels_note,
                               layer_efficiency, mixer_flops)
from slideformer.engine.kernels.dispatch import kernel_path
from slideformer.engine.runtime.shapes import BUFFERS, ExecShape, padded
from slideformer.engine.runtime.shapes import disk_layers as nvme_layers
from slideformer.engine.runtime.nf4 import CHUNK as NF4_CHUNK, Nf4Layout


NF4_TORCH_FACTOR = 5.0
"""How many times longer than the ``dq`` term (the Triton kernel's traffic at DEVICE_MEMORY_GBS)
the PyTorch form of the NF4 dequantisation takes: 4.7-5.8x over seven model shapes' layers on an
H100 (benchmarks/family_layers.py, 2026-12-07: measured PyTorch-form time over the plan's
kernel figure; the kernel itself ran 6.9-11.9x faster than the PyTorch form, at 1.3-2.5 TB/s,
where DEVICE_MEMORY_GBS assumes a consumer card's 1 TB/s). Runs without the fused ops (no
triton, SLIDEFORMER_TRITON=0) take it."""

ADAPTER_BYTES = 2.25
"""Device bytes each adapter moves per token, pass and element of its input + output (x A^T,
its product with B^T, the sum into the projection's output, and the backward's three products),
at DEVICE_MEMORY_GBS. Fitted on the H200 (benchmarks/RESULTS.md, fourth session, Llama-3.1-8B,
rank 8 on all seven projections, no dropout, fused kernels): the layer model alone planned
1.204 / 4.813 s for 16K / 64K tokens per step where the runs took 1.494 / 5.979 s: the same
17.7 us more per token, over 32 layers x 81,920 elements x 3 passes. Small, skinny products and
their launches: not matmul-bound work, so it does not scale with the layer's FLOPs."""


def layer_bytes(spec: ModelSpec, prec: Precision, method: str) -> int:
    """One decoder layer's base as stored on the host and in a slot."""
    if method == "qlora":
        return Nf4Layout.build(spec.largest_layout, prec.compute).nbytes
    return spec.params_per_layer * prec.c



def base_reads(num_layers: int, slots: int, disk: list[int], buffers: int = BUFFERS) -> int:
    """Disk reads of base layers in a step after the first two (module docstring).

    The forward loads the layers not kept in a slot since the last backward (all but the first
    K), the backward those no longer in a slot after the forward (all but the last K); a layer
    still in one of the tier's ``buffers`` staging buffers (the least recently used is reused
    first) is not read again.
    """
    L, k, on = num_layers, max(1, min(slots, num_layers)), set(disk)
    windows = ([i for i in range(k, L) if i in on], [i for i in reversed(range(L - k)) if i in on])
    staged: list[int] = []  # the buffers' layers, least recently used first
    for _ in range(3):
        reads = 0
        for window in windows:
            for i in window:
                if i in staged:
                    staged.remove(i)
                else:
                    reads += 1
                    del staged[:len(staged) + 1 - buffers]
                staged.append(i)
    return reads


def frozen_allocations(spec: ModelSpec, shape: ExecShape, prec: Precision, device: str,
                       packed: bool, method: str, lora: LoraSpec,
                       disk_layers: int = 0) -> tuple[Allocation, ...]:
    """Every allocation of a frozen-base run (module docstring); the base of ``disk_layers``
    decoder layers on the NVMe tier."""
    c, L, P = prec.c, spec.num_layers, spec.params_per_layer
    E, Hd = spec.embed_layout.numel, spec.head_layout.numel
    lb, A = layer_bytes(spec, prec, method), adapter_params(spec, lora)
    rem = 2 if prec.compute == torch.bfloat16 else 0
    pinned = " (pinned)" if device == "cuda" else ""
    kind = "NF4 + double-quantised scales" if method == "qlora" else f"{c} B/param"
    n = L - disk_layers
    mo = 2 * sum(prec.moment_bytes(adapter_layout(spec, lora, i).numel) for i in range(L))  # m, v
    out = [Allocation("host", "frozen base weights", n * lb + (E + Hd) * c,  # FrozenItem.w
                      f"{n} layers x {lb:,} B ({kind}) + embedding and head x {c} B{pinned}"
                      + (f"; {disk_layers} layers on disk" if disk_layers else ""), "state"),
           Allocation("host", "adapters (checkpoint copy)", A * (c + rem) + mo,
                      f"{A:,} adapter params x {c + rem + 2 * prec.mo} B (weights, remainder, m, v)",
                      "state"),
           runtime_baseline(device, kernel_path(device, spec.max_head_dim, packed)),
           Allocation("host", "runtime working memory", RUNTIME_WORKING,
                      "heap and library buffers kept across steps", "run")]
    out += [frozen_loading(spec, prec, method)] + base_on_disk(spec, prec, method, disk_layers)
    k = max(1, min(shape.slots, L))
    out += [Allocation("gpu", "parameter slots", k * lb, f"{k} slots x {lb:,} B"),  # SlotPool
            Allocation("gpu", "embedding weights", E * c, f"{E:,} params x {c} B"),
            Allocation("gpu", "head weights", Hd * c, f"{Hd:,} params x {c} B"),
            Allocation("gpu", "adapters and their optimizer state", A * (c + rem + 4) + mo,
                       f"{A:,} params x {c + rem + 2 * prec.mo + 4} B (weights, remainder, m, v, "
                       "fp32 grad)"),
            device_optimizer_scratch(prec, device, _largest_adapter(spec, lora).numel)]
    if method == "qlora":
        out.append(Allocation("gpu", "dequantised layer", P * c, f"{P:,} params x {c} B"))
        out.append(dequant_scratch(spec))
    out += checkpoint_store(spec, shape, prec) + cuda_fixed(device)
    out += step_transients(spec, shape, prec, kernel_path(device, spec.max_head_dim, packed),
                           frozen_base(spec, prec, lora))
    if device == "cuda":
        out.append(allocator_reserve(out, shape, spec, prec, frozen=True))
    return tuple(out)


def frozen_base(spec: ModelSpec, prec: Precision, lora: LoraSpec) -> FrozenBase:
    """A frozen layer's backward (slideformer.engine.models.lora.LoraForward under autograd): the
    adapters' grads in the compute dtype and their fp32 copy; saved per token, each A's output,
    and with dropout each target's keep mask (in the compute dtype) and its dropped input."""
    layout = spec.largest_layout  # the layer with the most adapters (layers may differ)
    targets = [t for t in lora.targets if PROJECTIONS[t] + ".weight" in layout.names()]
    ins = sum(layout.shape(PROJECTIONS[t] + ".weight")[1] for t in targets)
    saved = len(targets) * lora.rank + (2 * ins if lora.dropout else 0)
    return FrozenBase(_largest_adapter(spec, lora).numel * (prec.c + 4), saved * prec.c)


def _largest_adapter(spec: ModelSpec, lora: LoraSpec):
    return max((adapter_layout(spec, lora, i) for i in range(spec.num_layers)),
               key=lambda lay: lay.numel)


def base_on_disk(spec: ModelSpec, prec: Precision, method: str, disk_layers: int) -> list[Allocation]:
    """NvmeTier.place (a padded file per layer) and its staging buffers (NvmeTier._take_buffer:
    at most BUFFERS, one per disk layer at most; allocated by the loading's writes)."""
    if not disk_layers:
        return []
    b, k = padded(layer_bytes(spec, prec, method)), min(disk_layers, BUFFERS)
    return [Allocation("host", "base staging buffers", k * b, f"{k} x one layer's base", "state"),
            Allocation("disk", "frozen base on NVMe", disk_layers * b, f"{disk_layers} of "
                       f"{spec.num_layers} layers ({b / (1 << 30):.2f} GiB each)")]


def frozen_loading(spec: ModelSpec, prec: Precision, method: str) -> Allocation:
    """load_weights of a frozen base: each item is read straight into its weights (in RAM, or
    a staging buffer of its NVMe file), so beside them it holds only, for an item kept in the
    compute dtype, its finiteness mask (1 B/param) or a tensor's read scratch; for a quantised
    layer (Checkpoint.read_nf4_item), one matrix as stored (stacked experts: also their
    separate parts), then its mask, or Nf4Layout.quantize_tensor's fp32 block scales and its
    chunk temporaries (fp32 blocks, int64 indices: 24 B per weight of a chunk)."""
    E, Hd, fb = spec.embed_layout.numel, spec.head_layout.numel, prec.file_bytes
    floats = max(E, Hd) if method == "qlora" else max(E, Hd, spec.params_per_layer)
    need = max(floats, read_scratch(spec, prec, prec.compute))
    if method == "qlora":
        for t in Nf4Layout.build(spec.largest_layout, prec.compute).tensors:
            parts = 2 if len(spec.stored_names(t.name)) > 1 else 1
            quantise = t.numel // 16 + 24 * min(NF4_CHUNK, t.numel)
            need = max(need, parts * t.numel * fb + max(t.numel, quantise))
    return Allocation("host", "load buffer", need,
                      "a tensor as stored + its finiteness mask, or the quantiser's scratch", "setup")


def dequant_scratch(spec: ModelSpec) -> Allocation:
    """Nf4Layout.dequantize: per chunk (at most the largest matrix) the int64 codes, the fp32
    pairs and their product; per matrix its absmax codes as int64 and three fp32 vectors. It
    runs before a layer's forward or recompute, when none of their scratch is held."""
    biggest = max(math.prod(s) for lay in set(spec.layouts) for _, _, s in lay.entries)
    b = min(NF4_CHUNK, biggest) * (4 + 4 + 4) + biggest // 64 * (8 + 12)
    return Allocation("gpu", "dequantisation temporaries", b,
                      f"chunks of {NF4_CHUNK:,} weights; {biggest // 64:,} block scales", "dequant")


def frozen_estimate(spec: ModelSpec, shape: ExecShape, prec: Precision, device: str,
                    hw: HardwareProfile, method: str, lora: LoraSpec,
                    packed: bool = True, disk_layers: int = 0) -> SpeedEstimate:
    """Step time of a frozen-base run (module docstring)."""
    L, P, k = spec.num_layers, spec.params_per_layer, max(1, min(shape.slots, spec.num_layers))
    B, T, n = shape.micro_batch, shape.seq_len, shape.n_micro
    tokens = B * T * n
    lin = 2.0 * spec.active_params_per_layer * B * T * n  # a token's experts only
    att = mixer_flops(spec, B, T) * n
    head_f = 4.0 * tokens * spec.vocab_size * spec.hidden_size
    flops = L * (lin + att + 2 * lin + 3 * att) + head_f
    lb = layer_bytes(spec, prec, method)
    A = adapter_params(spec, lora)
    read = base_reads(L, k, nvme_layers(L, disk_layers)) * padded(lb) / (hw.disk_read_gbs * 1e9)
    if device != "cuda":
        busy = {"gpu compute": flops / (hw.cpu_tflops * 1e12) + cpu_dispatch_s(L, n),
                "pcie h2d": 2 * L * lb / (CPU_COPY_GBS * 1e9), "pcie d2h": 0.0,
                "cpu optimizer": A * DEVICE_ADAM_BYTES / (CPU_COPY_GBS * 1e9), "disk": read}
        return _result(sum(busy.values()), tokens, busy, flops, "CPU backend: nothing overlaps")
    path = kernel_path(device, spec.max_head_dim, packed)
    rate = hw.matmul_tflops * 1e12 * layer_efficiency(path, hw)[0]
    mem = DEVICE_MEMORY_GBS * 1e9
    dq = (lb + P * prec.c) / mem if method == "qlora" else 0.0  # read NF4, write the layer
    if not path.fused_ops:
        dq *= NF4_TORCH_FACTOR
    io = adapter_params(spec, lora) // spec.num_layers // max(lora.rank, 1)  # in + out, targets
    ad = n * B * T * io * ADAPTER_BYTES / mem  # one pass of a layer's adapters
    irr = irregular(spec, B, T, hw, device, path.fused_ops)  # experts, delta rule: measured
    i_fwd, i_bwd = irr.flops(frozen=True)
    f = (lin - fp8_saving(spec, tokens, 1, prec) + att - n * i_fwd) / rate + n * irr.fwd + dq + ad
    b = (2 * lin - fp8_saving(spec, tokens, 2, prec) + 3 * att - n * i_bwd) / rate \
        + n * irr.frozen + dq + 2 * ad
    load = lb / (hw.h2d_gbs * 1e9)
    upd = A * DEVICE_ADAM_BYTES / mem
    streamed = L - k  # the first K layers stay resident across steps
    disk = read / (2 * streamed) if streamed else 0.0  # per streamed layer and window
    fwd = (_pipeline(streamed, [load, f, disk]) if streamed else 0.0) + k * f
    bwd = (_pipeline(streamed, [load, b, disk]) if streamed else 0.0) + k * b
    head = head_f / (hw.matmul_tflops * 1e12 * HEAD_EFFICIENCY)
    step = fwd + head + bwd + upd
    busy = {"gpu compute": L * (f + b) + head + upd, "pcie h2d": 2 * (L - k) * load,
            "pcie d2h": 0.0, "cpu optimizer": 0.0, "disk": read}
    note = ""
    if step > SERIAL * max(busy.values()):
        note = "layer loads and compute take turns: the pipeline fills and drains"
    return dataclasses.replace(_result(step, tokens, busy, flops, note),
                               kernels=kernels_note(path, hw, irr))
