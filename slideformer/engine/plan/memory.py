"""Every byte a run allocates, by tier, purpose and phase: the planner's single source of truth.

:func:`allocations` mirrors, term by term, what the engine allocates for a model spec, an
executor shape and the precisions: the host state (slideformer.engine.runtime.host_state.HostItem), weight
loading (slideformer.engine.train.state.load_weights), the executor's device buffers (all allocated in
``SlidingExecutor.__init__``) and the transient tensors of a training step. Each term's comment
names the allocation it mirrors; when the engine changes, this file changes with it.

Phases say when memory is held, so peaks are not the plain sum of everything:
  state     allocated before the weights load, held for the run (host state, runtime)
  setup     only while the weights load
  run       allocated when the executor starts, held for the run
  step      allocated at the start of each step, freed at its end
  dequant, forward, head, backward   live only within that part of a step (dequant: an NF4
            layer's dequantisation, before its forward or recompute)
  rollout   GRPO's sampling between steps (:func:`rollout_allocations`)
peak = max(state + setup, state + run + step + max(dequant, forward, head, backward),
           state + run + rollout).

The step's transient terms (slideformer.engine.plan.transients) were checked against allocator
traces of the real functions (CPU: profiler memory events, tests/engine/plan/test_plan_memory.py
per layer and tests/engine/plan/test_plan_step_memory.py per step; CUDA: max_memory_allocated on
the reference machine, within 2.5% for a Llama-3.2-3B layer and LM head at 8 x 1024 tokens). A
decoder layer's terms depend on the kernel path (slideformer.engine.kernels.dispatch.kernel_path,
the executor's own choice): the PyTorch ops, or the fused Triton ones with FlexAttention on
CUDA, each checked against max_memory_allocated by tests/engine/plan/test_plan_memory_gpu.py.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from slideformer.engine.kernels.dispatch import kernel_path
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.models.weights import READ_CHUNK
from slideformer.engine.plan.allocation import Allocation, Precision, _dt, _gib
from slideformer.engine.plan.transients import step_transients
from slideformer.engine.runtime.shapes import (BUFFERS, CHUNK, DEVICE_CHUNK, QBLOCK, QBLOCK_BYTES,
                                                QCHUNK, QCHUNK_TEMP, ExecShape, file_bytes,
                                                regen_layers, speculative_layers)
from slideformer.engine.runtime.shapes import disk_layers as nvme_layers

MiB = 1 << 20
TIERS = ("gpu", "host", "disk")
PHASES = ("state", "setup", "run", "step", "dequant", "forward", "head", "backward", "rollout")
STEP_PARTS = ("forward", "head", "backward", "dequant")  # ties name the first

# Measured on the reference GPU machine (torch 2.11, CUDA 13, H200), 2026-11-29:
# - host RSS of the process before the run allocates: 0.83 GiB once torch is imported and a CUDA
#   context ran its first matmul and attention (0.48 GiB after `import torch` alone, the figure
#   kept for the CPU backend: CUDA builds of torch load their libraries either way);
# - GPU memory outside PyTorch's allocator (NVML's per-process use less torch's reserved):
#   0.74 GiB after start-up, 0.81 GiB during training (more kernels loaded);
# - inside the allocator beyond our tensors: cuBLAS workspaces and small buffers, ~0.1 GiB
#   (allocated-peak minus predicted tensors over five Llama-3.2-3B runs, -0.5% .. -0.8%);
# - the caching allocator's reserved-but-free memory at the peak (reserved - allocated):
#   2.7-3.1 GiB with GPU checkpoints, 3.85 GiB with host checkpoints, for step transients of
#   0.6 / 2.7 / 1.4 GiB (forward / head / backward). Freed blocks of one part of the step do
#   not fit the next part's requests, and host checkpoints keep each layer's inputs alive until
#   their copy finishes. Modelled as 65% of the three parts' transients plus the inputs held
#   for host checkpoint copies, which over-predicts those five runs by 0.6-1.9%.
HOST_RUNTIME = {"cuda": 896 * MiB, "cpu": 512 * MiB}
JIT_HOST = {"triton": 100 * MiB, "flex": 300 * MiB}
"""Host memory the JIT compilers a CUDA run starts keep for the process's life, beyond
HOST_RUNTIME (benchmarks/host_baseline.py on the reference H100, torch 2.11, Triton 3.6,
2026-12-07: RSS grew 99.5 MiB when the fused Triton ops compiled and ran, 299 MiB more when
FlexAttention did, through torch.compile's Inductor; 74 MiB more once NF4 quantisation and its
dequantisation kernel had run on the GPU, not counted here)."""
STEP_MODULES = 320 * MiB
"""Host memory a CUDA training step adds beyond HOST_RUNTIME (whose figure comes from one
matmul and one attention) and JIT_HOST, not attributed by a measurement of its own: the three
Llama-3.1-8B full fine-tunes at 64K tokens with 8-bit moments on the reference H100
(2026-12-07, no FlexAttention) peaked 0.23, 0.33 and 0.28 GiB over their plans with the Triton
term counted. CUDA loads a kernel's module on its first launch (lazy loading), and a step
launches hundreds of kernels the baseline never did; that is the likely owner."""


def runtime_baseline(device: str, path=None) -> Allocation:
    """Python, torch and the CUDA runtime, plus the JIT compilers ``path``'s kernels start
    (a kernels.dispatch.KernelPath; None: none)."""
    b, what = HOST_RUNTIME[device], "Python, torch" + (" and the CUDA runtime" if device == "cuda" else "")
    if device == "cuda":
        b += STEP_MODULES
        what += ", the step's kernels"
    if device == "cuda" and path is not None and path.fused_ops:
        b += JIT_HOST["triton"]
        what += ", Triton's compiler"
        if path.attention == "flex":
            b += JIT_HOST["flex"]
            what += ", torch.compile (FlexAttention)"
    return Allocation("host", "runtime baseline", b, what, "state")
# Host memory a training process keeps beyond its tensors once steps run: glibc's heap holding
# freed transients, library buffers, Python objects. 20-55 MB measured on the CPU backend over
# the first steps of the models in tests/engine/plan/test_plan_rss.py.
RUNTIME_WORKING = 32 * MiB
CUDA_CONTEXT = 832 * MiB
CUDA_WORKSPACES = 112 * MiB
ALLOCATOR_SLACK = 0.65
# With a frozen base (lora / qlora; 2026-12-01, same machine, six runs of the Llama-3.1-8B,
# 70B and Mistral-Large-2 shapes, GPU and host checkpoints) reserved-but-free memory at the
# peak was 0.27-1.92 GiB, 12-26% of the step parts' transients: the layers' activations repeat
# the same sizes layer after layer, with no weight grads of other sizes between them, and no
# gradient copies queue ahead of the checkpoint copies on the device-to-host lane (whose inputs
# then are freed about as soon as they are saved). Modelled as 25% of the transients.
ALLOCATOR_SLACK_FROZEN = 0.25
ALLOCATOR_FLOOR = 128 * MiB



# ---- host state and loading -----------------------------------------------------------------
def host_state(spec: ModelSpec, shape: ExecShape, prec: Precision, device: str,
               disk_layers: int = 0, clip: bool = True, path=None) -> list[Allocation]:
    """HostItem.w / rem / m / v / g of every item (embed, L layers, head), and the runtime.

    The moments of ``disk_layers`` decoder layers live in the NVMe tier (slideformer.engine.runtime.nvme)
    instead, and pass through its staging buffers (one layer's m and v each). Without
    clipping the decoder layers own no gradient buffer and share the executor's ring; the
    speculative layers (slideformer.engine.runtime.grad_ring) keep their gradient in their snapshot;
    with clipping the regenerated layers (slideformer.engine.runtime.regen) own none and use the ring.
    """
    n, c, L, P = spec.num_params, prec.c, spec.num_layers, spec.params_per_layer
    regen = regen_layers(L, shape.device_layers, shape.regen_layers)  # never speculative
    spec_n = len(speculative_layers(L, shape.device_layers, shape.spec_layers,
                                    nvme_layers(L, disk_layers) + regen))
    regen_n = len(regen) if clip else 0
    ends = 0 if shape.device_update else spec.embed_layout.numel + spec.head_layout.numel
    G = min(shape.device_layers, L)  # the device-updated items keep their gradient there
    if clip:  # HostItem.g of every host item but the speculative layers (their snapshots hold it)
        kept = ends + (L - G) * P
        grads, grad_note = kept * 4, f"{kept:,} params x 4 B (fp32)"
        if regen_n:  # the regenerated layers own none: the ring serves them in pass 2
            ring = min(shape.grad_ring, regen_n)
            grads += (ring - regen_n) * P * 4
            grad_note = (f"{kept - regen_n * P:,} params + a ring of {ring} layers x 4 B (fp32; "
                         f"{regen_n} layers' gradients regenerated)")
    else:  # HostItem.g of embed and head + the ring (+ the speculative layers' snapshots)
        ring = min(shape.grad_ring, L) if spec_n < L else 0
        grads = (ends + (ring + spec_n) * P) * 4
        grad_note = (f"{'embedding, head and ' if ends else ''}a ring of {ring} layers x 4 B "
                     "(fp32; no clipping)")
    on_disk = set(nvme_layers(L, disk_layers))
    items = [spec.embed_layout.numel, spec.head_layout.numel]  # HostItem.m, .v in RAM
    items += [lay.numel for i, lay in enumerate(spec.layouts) if i not in on_disk]
    in_ram = sum(items)
    pinned = " (pinned)" if device == "cuda" else ""
    out = [Allocation("host", f"{_dt(prec.compute)} weights", n * c,  # HostItem.w
                      f"{n:,} params x {c} B{pinned}", "state")]
    if prec.compute == torch.bfloat16:  # HostItem.rem: the low 16 bits of the fp32 master
        out.append(Allocation("host", "weight remainders", n * 2, f"{n:,} params x 2 B (int16)", "state"))
    out += [Allocation("host", "AdamW moments m, v", 2 * sum(map(prec.moment_bytes, items)),
                       f"2 x {in_ram:,} params x " + (
                           f"{prec.mo} B ({_dt(prec.moments)})" if prec.moments != torch.int8 else
                           f"{QBLOCK_BYTES / QBLOCK:.4f} B (8-bit blocks of {QBLOCK} and a scale)")
                       + (f"; {disk_layers} layers' moments on disk" if disk_layers else ""), "state"),
            Allocation("host", "gradient buffers", grads,  # HostItem.g, fp32
                       grad_note + pinned, "state"),
            runtime_baseline(device, path),
            Allocation("host", "runtime working memory", RUNTIME_WORKING,
                       "heap and library buffers kept across steps", "run")]
    if spec_n:  # Speculation's snapshots: w, rem, m, v of each speculative layer
        b = P * (c + (2 if prec.compute == torch.bfloat16 else 0)) + 2 * prec.moment_bytes(P)
        out.append(Allocation("host", "speculative update snapshots", spec_n * b,
                              f"{spec_n} layers' pre-update state ({_gib(b)} each)", "state"))
    if disk_layers:  # NvmeTier._take_buffer: at most BUFFERS, one per disk layer at most
        k, b = min(disk_layers, BUFFERS), file_bytes(spec.params_per_layer, prec.compute, prec.moments)
        out.append(Allocation("host", "NVMe staging buffers", k * b,
                              f"{k} x one layer's m, v ({_gib(b)})", "run"))
    return out


def _largest_tensor(spec: ModelSpec) -> int:
    layouts = (spec.embed_layout, *set(spec.layouts), spec.head_layout)
    return max(math.prod(s) for lay in layouts for _, _, s in lay.entries)


def loading(spec: ModelSpec, prec: Precision) -> list[Allocation]:
    """load_weights: the largest item's fp32 buffer (freed before the next is allocated), and
    beside it the largest of: its finiteness mask (1 B/param), a tensor's read scratch
    (read_scratch) and HostItem.set_master's split temporaries. The files are read, never
    mapped (slideformer.engine.models.weights), so none of their pages count in RSS."""
    item = max(spec.embed_layout.numel, spec.params_per_layer, spec.head_layout.numel)
    split = CHUNK * 4 if prec.compute == torch.bfloat16 else 0  # set_master's fp32 copy to split
    buf = item * 4 + max(item, read_scratch(spec, prec, torch.float32), split)
    return [Allocation("host", "load buffer", buf, "one item in fp32 + its finiteness mask (1 B/param)",
                       "setup")]


def read_scratch(spec: ModelSpec, prec: Precision, into: torch.dtype) -> int:
    """Checkpoint._read_into: a tensor stored in another dtype than ``into`` is read through a
    scratch of at most READ_CHUNK bytes (none when the files hold ``into``: read in place)."""
    if prec.file_bytes == into.itemsize:
        return 0
    return min(READ_CHUNK, _largest_tensor(spec) * prec.file_bytes)


# ---- executor buffers -----------------------------------------------------------------------
def device_buffers(spec: ModelSpec, shape: ExecShape, prec: Precision, device: str) -> list[Allocation]:
    """SlidingExecutor.__init__: slots, resident embed/head, fp32 grads, checkpoint store.

    Left out: the executor's scalars (grad-norm accumulator, per-layer health flags: L + 2
    floats) and the host copies of the latter."""
    c, P, L = prec.c, spec.params_per_layer, spec.num_layers
    E, Hd = spec.embed_layout.numel, spec.head_layout.numel
    k = max(1, min(shape.slots, L))
    out = [Allocation("gpu", "parameter slots", k * P * c, f"{k} slots x {P:,} params x {c} B"),  # SlotPool
           Allocation("gpu", "embedding weights", E * c, f"{E:,} params x {c} B"),  # embed_w
           Allocation("gpu", "head weights", Hd * c, f"{Hd:,} params x {c} B"),  # head_w
           Allocation("gpu", "embedding grads", E * 4, f"{E:,} params x 4 B (fp32)"),  # embed_g
           Allocation("gpu", "head grads", Hd * 4, f"{Hd:,} params x 4 B (fp32)"),  # head_g
           Allocation("gpu", "gradient slots", shape.grad_slots * P * 4,  # gslots
                      f"{shape.grad_slots} slots x {P:,} params x 4 B (fp32)")]
    out += checkpoint_store(spec, shape, prec)
    if prec.wide:
        out += norm_remainders(spec, shape)
    out.append(optimizer_scratch(prec))
    out += device_optimizer(spec, shape, prec)
    return out + cuda_fixed(device)


def checkpoint_store(spec: ModelSpec, shape: ExecShape, prec: Precision) -> list[Allocation]:
    """The activation checkpoints: one layer input per layer and micro-batch (residual dtype)."""
    c, L = prec.r, spec.num_layers
    act = shape.micro_batch * shape.seq_len * spec.hidden_size * c  # one checkpoint (B, T, H)
    ck = f"{shape.n_micro} micro-batches x {shape.micro_batch}x{shape.seq_len}x{spec.hidden_size} x {c} B"
    g = min(shape.gpu_checkpoints, L) if shape.checkpoints == "host" else L
    out = []
    if g < L:  # HostStore: pinned host copy + two device staging layers
        out += [Allocation("gpu", "checkpoint staging", 2 * shape.n_micro * act, f"2 layers x {ck}"),
                Allocation("host", "pinned activation checkpoints", (L - g) * shape.n_micro * act,
                           f"{L - g} layers x {ck}")]
    if g:  # DeviceStore (all layers, or the top g of a SplitStore)
        out.append(Allocation("gpu", "activation checkpoints", g * shape.n_micro * act,
                              f"{g} layers x {ck}" + (" (the top layers; the rest on the host)"
                                                     if g < L else "")))
    return out


def norm_remainders(spec: ModelSpec, shape: ExecShape) -> list[Allocation]:
    """NormMasters: the remainders of the norm weights of the host-updated layers and head, on
    the device and in their pinned host staging (int16)."""
    G = min(shape.device_layers, spec.num_layers)
    n = sum(k for i in range(G, spec.num_layers) for _, _, k in spec.layout(i).norms())
    n += 0 if shape.device_update else sum(k for _, _, k in spec.head_layout.norms())
    note = f"{n:,} norm weights x 2 B (int16)"
    return [Allocation("gpu", "norm weight remainders", 2 * n, note),
            Allocation("host", "norm remainder staging", 2 * n, note + " (pinned)")]


def cuda_fixed(device: str) -> list[Allocation]:
    """The CUDA context and library workspaces (none on the CPU backend)."""
    if device != "cuda":
        return []
    return [Allocation("gpu", "CUDA context", CUDA_CONTEXT, "driver context and kernels", "state"),
            Allocation("gpu", "cuBLAS workspaces", CUDA_WORKSPACES,
                       "library workspaces and small buffers in the allocator", "state")]


def device_optimizer(spec: ModelSpec, shape: ExecShape, prec: Precision) -> list[Allocation]:
    """DeviceItem state of the items updated on the device, and the update's scratch
    (AdamWorkspace of DEVICE_CHUNK: the joined master, and upcast moments if bf16)."""
    G = min(shape.device_layers, spec.num_layers)
    if not (shape.device_update or G):
        return []
    rem = 2 if prec.compute == torch.bfloat16 else 0
    E, Hd, P = spec.embed_layout.numel, spec.head_layout.numel, spec.params_per_layer
    out = []
    if shape.device_update:  # weights and grads are the resident buffers already counted
        out.append(Allocation("gpu", "embedding and head optimizer state",
                              (E + Hd) * rem + 2 * (prec.moment_bytes(E) + prec.moment_bytes(Hd)),
                              f"{E + Hd:,} params x {rem + 2 * prec.mo} B (remainder, m, v)"))
    if G:
        b = prec.c + rem + 2 * prec.mo + 4
        out.append(Allocation("gpu", "device layers", G * (P * (b - 2 * prec.mo) + 2 * prec.moment_bytes(P)),
                              f"{G} layers x {P:,} params x {b} B (weights, remainder, m, v, fp32 grad)"))
    return out + [device_optimizer_scratch(prec)]


def device_optimizer_scratch(prec: Precision, device: str = "cuda",
                             largest: int = DEVICE_CHUNK) -> Allocation:
    """The device update's AdamWorkspace (DEVICE_CHUNK fp32; upcast moments if bf16). On the
    CPU backend it is host memory allocated empty, so only what the update writes becomes
    resident (as in optimizer_scratch): the joined master (bf16 compute) and the upcast moments,
    over the ``largest`` item updated there (measured: tests/engine/plan/test_plan_rss.py)."""
    if device == "cuda":
        scratch = DEVICE_CHUNK * 4 * (1 if prec.moments == torch.float32 else 3)
    else:
        fields = (prec.compute == torch.bfloat16) + 2 * (prec.moments != torch.float32)
        scratch = min(QCHUNK if prec.moments == torch.int8 else DEVICE_CHUNK, largest) * 4 * fields
    if prec.moments == torch.int8:  # 8-bit moments: the requantise's temporaries
        scratch += QCHUNK_TEMP * min(QCHUNK, largest)
    return Allocation("gpu", "device optimizer scratch", scratch, f"chunks of {DEVICE_CHUNK:,} params in fp32")


def optimizer_scratch(prec: Precision) -> Allocation:
    """AdamWorkspace: 3 x CHUNK fp32 allocated empty, so only the parts the update writes become
    resident: the joined master (bf16 compute, PyTorch-op path; the compiled kernel needs none)
    and the upcast moments (bf16 moments). The compiled kernel updates 8-bit moments in place,
    block by block: none (without a C compiler the PyTorch-op path would hold up to 26 MiB:
    QCHUNK values of master and moments in fp32 and the requantise's temporaries). Predicted
    against measured RSS of whole runs with 8-bit moments: -0.2% (fp32 compute, clipping) and
    +1.6% (bf16, no clipping), tests/engine/plan/test_plan_rss.py, 2026-12-07."""
    if prec.moments == torch.int8:
        return Allocation("host", "optimizer scratch", 0, "none: 8-bit moments update in place")
    b = CHUNK * 4 if prec.compute == torch.bfloat16 else 0  # ws.p
    if prec.moments != torch.float32:
        b += 2 * CHUNK * 4  # ws.m, ws.v
    return Allocation("host", "optimizer scratch", b, f"chunks of {CHUNK:,} params in fp32")


def regen_boundary(spec: ModelSpec, shape: ExecShape, prec: Precision, clip: bool) -> list[Allocation]:
    """Regeneration.boundary: dL/dx entering the top regenerated layer, one hidden state per
    token, held from pass 1 through pass 2 (slideformer.engine.runtime.regen)."""
    if not (clip and regen_layers(spec.num_layers, shape.device_layers, shape.regen_layers)):
        return []
    n, N, H = shape.n_micro, shape.micro_batch * shape.seq_len, spec.hidden_size
    return [Allocation("gpu", "regenerated-gradient boundary", n * N * H * prec.r,
                       f"{n} micro-batches x {shape.micro_batch}x{shape.seq_len}x{H} x {prec.r} B",
                       "backward")]





def allocator_reserve(allocs: list[Allocation], shape: ExecShape, spec: ModelSpec,
                      prec: Precision, frozen: bool = False) -> Allocation:
    """CUDA caching-allocator memory reserved but free at the peak (calibration above), for a
    trained base or a ``frozen`` one."""
    parts = sum(a.bytes for a in allocs if a.tier == "gpu" and a.phase in STEP_PARTS)
    held = 0
    if shape.checkpoints == "host" and not frozen:  # HostStore.save keeps each input alive until its copy ends
        held = 2 * shape.n_micro * shape.micro_batch * shape.seq_len * spec.hidden_size * prec.r
    slack = ALLOCATOR_SLACK_FROZEN if frozen else ALLOCATOR_SLACK
    return Allocation("gpu", "allocator reserve", ALLOCATOR_FLOOR + int(slack * parts) + held,
                      f"{slack:.0%} of the step parts' transients"
                      + (" + inputs awaiting their checkpoint copies" if held else ""))


def allocations(spec: ModelSpec, shape: ExecShape, prec: Precision, device: str,
                packed: bool, disk_layers: int = 0, clip: bool = True) -> tuple[Allocation, ...]:
    """Every allocation of a run with this model, executor shape and precision.

    Args:
        device: ``cuda`` or ``cpu`` (the CPU backend has no CUDA context or allocator reserve,
            and its "gpu" buffers are host memory).
        packed: sequences are packed (attention masks exist).
        disk_layers: decoder layers whose moments the NVMe tier holds.
        clip: exact global-norm clipping (every layer keeps its gradient until the norm is known).
    """
    path = kernel_path(device, spec.max_head_dim, packed)
    out = host_state(spec, shape, prec, device, disk_layers, clip, path) + loading(spec, prec)
    out += device_buffers(spec, shape, prec, device)
    out += step_transients(spec, shape, prec, path)
    out += regen_boundary(spec, shape, prec, clip)
    if device == "cuda":
        out.append(allocator_reserve(out, shape, spec, prec))
    b = file_bytes(spec.params_per_layer, prec.compute, prec.moments)  # NvmeTier.place
    out.append(Allocation("disk", "NVMe tier", disk_layers * b,
                          f"AdamW moments of {disk_layers} of {spec.num_layers} layers ({_gib(b)} each)",
                          "state"))
    return tuple(out)


def _by_phase(allocs, tiers: tuple[str, ...]) -> defaultdict[str, int]:
    """Bytes held in ``tiers`` per phase, in one pass (the planner sums thousands of times a
    plan: one pass per phase took a fifth of a plan's time, measured)."""
    sums: defaultdict[str, int] = defaultdict(int)
    for a in allocs:
        if a.tier in tiers:
            sums[a.phase] += a.bytes
    return sums


def peak(allocs, tiers: tuple[str, ...]) -> int:
    """Peak bytes held in ``tiers`` together (phases as in the module docstring)."""
    s = _by_phase(allocs, tiers)
    loading_ = s["state"] + s["setup"]
    training = s["state"] + s["run"] + s["step"] + max(s[p] for p in STEP_PARTS)
    return max(loading_, training, s["state"] + s["run"] + s["rollout"])


def peak_phase(allocs, tiers: tuple[str, ...]) -> str:
    """The phase at which ``tiers`` peak: setup, forward, head, backward or rollout."""
    s = _by_phase(allocs, tiers)
    step = s["run"] + s["step"] + max(s[p] for p in STEP_PARTS)
    if s["setup"] > step and s["setup"] >= s["run"] + s["rollout"]:
        return "setup"
    if s["rollout"] > s["step"] + max(s[p] for p in STEP_PARTS):
        return "rollout"
    return max(STEP_PARTS, key=lambda p: s[p])


def rollout_allocations(spec: ModelSpec, prec: Precision, seq_len: int, rows: int = 1,
                        window: bool = False) -> list[Allocation]:
    """GRPO's sampling between steps (slideformer.engine.train.grpo): the KV cache of the
    ``rows`` replies decoded together (grpo.sample_groups), of ``seq_len`` positions each
    (generate.cache.KVCache); with a full fine-tune also the whole model resident
    on the device in the compute dtype (generate.window.ResidentWeights, read from the host
    state one item at a time as fp32 masters). A LoRA or QLoRA run (``window``) samples
    through its training window (grpo.WindowWeights): nothing more. Freed before the step
    trains."""
    c = prec.c
    kv = [Allocation("gpu", "sampling: the replies' KV cache",
                     spec.kv_values_per_token * seq_len * c * rows,
                     f"{spec.kv_values_per_token:,} keys and values x {seq_len} tokens "
                     f"x {rows} replies x {c} B", "rollout")]
    if window:
        return kv
    item = max(spec.params_per_layer, spec.embed_layout.numel, spec.head_layout.numel)
    return [Allocation("gpu", "sampling: the weights resident", spec.num_params * c,
                       f"{spec.num_params:,} parameters x {c} B", "rollout"), *kv,
            Allocation("host", "sampling: an item read as fp32", item * 4,
                       f"the largest item ({item:,}) x 4 B", "rollout")]
