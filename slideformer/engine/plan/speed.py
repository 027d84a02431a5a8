"""Predicted step time of the sliding-window executor, from a model of its schedule.

Resources: GPU compute, PCIe host->device, PCIe device->host, the CPU optimizer and the disk.

forward   simulated layer by layer as the executor issues it: before computing layer i the
          host waits for layer i's update and loads it, and prefetches layers up to i+K-1
          whose updates already finished, each into the slot layer j-K freed; the H2D stream
          copies in order; compute runs a layer once its copy landed. With exact clipping the
          updates run embed, 0 .. L-1, head on the CPU from the step's start (DESIGN §3.4).
head      waits for the head's update (last in that order), then runs
backward  a pipeline over L layers: H2D of the L-K layers no longer resident (and host
          checkpoints), recompute+backward, D2H of the fp32 gradients, and without clipping
          the CPU update of the layer; a pipeline phase takes L * max(stages) plus the other
          stages once (filling and draining).
Without clipping the next forward waits for the embedding's update, queued after the layers'.
speculation with exact clipping the S speculative layers (ExecShape.spec_layers, the first S of
          the backward) update during the backward, each after its gradient landed (into a
          second set of buffers: no copy, runtime.grad_ring); the other layers keep the
          barrier chain. Predicted for steps that do not clip; a step
          that clips stops speculating once the layers' partial norm exceeds the limit and
          redoes the speculative updates made before (at most S more updates).
regen     with exact clipping the R regenerated layers (ExecShape.regen_layers, the lowest R above
          the device layers) run a second backward after the barrier: a pipeline over R
          layers of their H2D again (weights, and host checkpoints), recompute+backward, D2H
          of the gradient and its CPU update, as without clipping; the barrier chain of the
          next forward starts after it (its updates queue behind pass 2's), and those layers
          are ready for it at once.
device    items updated on the device (ExecShape.device_update, device_layers: the first G layers)
          skip the CPU, the H2D loads and the gradient D2H; their update runs on the compute
          stream after the backward, moving DEVICE_ADAM_BYTES per parameter at
          DEVICE_MEMORY_GBS (a consumer card's memory bandwidth; an H200 is about 4x faster).
disk      the NVMe tier reads and writes the moments of its layers once per step; an update
          waits for its layer's read, and the disk layers are spread evenly over the depth, so
          the update chain advances at the slower of the CPU update and the disk's share per
          layer (its reads and writes spread over all L layers).

FLOPs: each layer does 2 P N in the forward, again in the recompute and 4 P N in the backward
(8 P N in all), plus attention (2 B T^2 q per pass, causal; backward twice the forward); the LM
head 6 N V H. The layers run at the profile's matmul rate times the efficiency of the kernel path
the run takes (:func:`layer_efficiency`: measured by ``slideformer bench --hardware`` where it
could, else LAYER_EFFICIENCY), the head at HEAD_EFFICIENCY of it. Two parts of a layer do
not run at that rate and are timed by measurement instead (:func:`irregular`): a mixture's
routed experts (by (token, expert) pairs x hidden size: EXPERT_PAIR_S) and the gated delta rule
on its PyTorch path (by tokens x value heads: DELTANET_RULE_S), both measured on an H100 and
scaled by the profile's matmul rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from slideformer.engine.kernels import fp8
from slideformer.engine.kernels.attention import FLASH_HEAD_DIM
from slideformer.engine.kernels.dispatch import KernelPath, kernel_path
from slideformer.engine.models.recompute import plain_layer
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.plan.hardware import HardwareProfile
from slideformer.engine.plan.memory import Precision
from slideformer.engine.runtime.shapes import ExecShape, file_bytes, regen_layers, speculative_layers
from slideformer.engine.runtime.shapes import disk_layers as nvme_layers

# Share of the 8192^3 bf16 matmul rate (the profile's matmul_tflops) a decoder layer's forward,
# recompute and backward reach, norms, RoPE, attention and elementwise ops included, by kernel
# path (slideformer.engine.kernels.dispatch.KernelPath.key). Measured on the reference H200 with
# benchmarks/layer_profile.py (one Llama-3.2-3B layer, micro-batch 64 x 1024, bf16; packed rows:
# documents of 1/8 the row) against the 759 TFLOP/s `slideformer bench --hardware` measured
# there: the layer's model FLOPs (layer_flops: forward + recompute + backward) over the summed
# forward and recompute + backward times, divided by 759.
#   PyTorch ops, SDPA causal                 29.3 + 88.9 ms  -> 0.607
#   PyTorch ops, SDPA boolean document mask  31.0 + 94.9 ms  -> 0.570
#   fused Triton, SDPA causal                21.9 + 67.5 ms  -> 0.802
#   fused Triton, FlexAttention              21.3 + 66.2 ms  -> 0.820
# The two mixes (one switch off, or a head dimension FlexAttention refuses) were not measured:
# the ops' figure times the attention kernel's factor over causal rows (FlexAttention 0.820/0.802
# with fused ops; the boolean mask 0.570/0.607 with PyTorch ops). The executor's compute spans at
# micro-batch 8 reached 0.54-0.57 of 730 TFLOP/s on the PyTorch-op path (0.52-0.55 of 759):
# smaller micro-batches sit a little below these figures, which the bench's own measurement
# (8 x 1024 tokens) sees.
_OPS = {"torch": 0.607, "fused": 0.802}
_ATTENTION = {"causal": 1.0, "flex": 0.820 / 0.802, "mask": 0.570 / 0.607}
LAYER_EFFICIENCY = {f"{o}+{a}": round(e * f, 3)
                    for o, e in _OPS.items() for a, f in _ATTENTION.items()}
UPDATE_CONTENTION = 1.38
"""How many times slower the CPU update runs inside a CUDA step than ``slideformer bench
--hardware`` measures it alone: the step's pinned copies (PCIe DMA into and out of host memory)
share its memory bandwidth. The median of six runs on the H200 (Llama-3.2-3B shape, 8K / 32K /
64K tokens under 24 and 8 GiB caps; benchmarks/RESULTS.md, 2026-12-02 second session: the
optimizer lane's busy time over the host-updated parameters, 1.31-1.63x)."""

INT8_UPDATE_COST = 3.1
"""How many times longer the compiled CPU update takes a parameter with 8-bit moments than with
fp32 ones (``optim.moments_dtype = "int8"``: table look-ups and a requantise per block, where the
fp32 update only streams memory): 2.03 against 0.65 G params/s on the 2-core development machine
(AVX-512, gathers vectorised; benchmarks/moments_int8.py --update-speed, 2026-12-07)."""


def update_s(prec: Precision, hw: HardwareProfile) -> float:
    """Seconds of the CPU update per parameter, alone (``hw.adam_params_per_s`` is measured with
    fp32 moments)."""
    return (INT8_UPDATE_COST if prec.moments == torch.int8 else 1.0) / hw.adam_params_per_s


FP8_SPEEDUP = 1.1
"""How many times faster the feed-forward's FP8 projection products (the forward, the recompute
and dL/dx: train.precision = "fp8", kernels.fp8) run than bf16 ones, their operands'
quantisation included. From benchmarks/fp8_linear.py on an H100 (2026-12-07, 8K tokens): a
projection's forward + dL/dx + dL/dW ran 0.99-1.23x bf16 (mean 1.06x over the 3B and 8B MLP
matrices), which is 1.1x on the two FP8 products with dL/dW unchanged. The bare FP8 product is
1.6-2.1x; quantising the operands takes most of the gain. The weight gradients stay bf16."""


def fp8_saving(spec: ModelSpec, tokens: int, passes: int, prec: Precision,
               skip_down: bool = False) -> float:
    """The bf16-equivalent FLOPs FP8 saves in ``passes`` passes of a layer's projections over
    ``tokens`` tokens. Only a dense MLP's matrices go through FP8 (kernels.fp8.PROJECTIONS), not
    the attention's, nor a mixture's experts or its shared expert (their own matmuls). ``skip_down``: the down projection is not in these passes (a trained plain
    layer's recompute and backward: recompute.layer_backward never forms its output, and its
    dL/dz is a bf16 product)."""
    if not prec.fp8:
        return 0.0
    mats = sum(math.prod(s) for n, _, s in spec.largest_layout.entries
               if n.startswith(fp8.PROJECTIONS) and n.endswith("_proj.weight") and len(s) == 2
               and "expert" not in n and not (skip_down and n == "mlp.down_proj.weight"))
    return passes * 2.0 * mats * tokens * (1 - 1 / FP8_SPEEDUP)


HEAD_EFFICIENCY = 0.55
"""The LM head's chunked GEMMs and loss, of the matmul rate: the executor's compute spans of
2026-11-29 (PyTorch cross-entropy), not re-measured with the Triton loss."""
DEVICE_ADAM_BYTES = 32  # bf16 w + remainder + fp32 grad + fp32 m, v: read all, write all but grad
DEVICE_MEMORY_GBS = 1000.0
# The CPU backend copies with memcpy and runs everything in one thread of control.
CPU_COPY_GBS = 10.0
# It runs each layer's forward, recompute and backward as eager PyTorch ops, each with a fixed
# dispatch cost that bounds small models: about CPU_OPS_PER_PASS ops per layer, micro-batch and
# pass at CPU_OP_S each (2-core development machine, 2026-12-01: the tiny demo model's steps).
CPU_OPS_PER_PASS = 60
CPU_OP_S = 20e-6


def layer_efficiency(path: KernelPath, hw: HardwareProfile) -> tuple[float, bool]:
    """Share of ``hw.matmul_tflops`` a decoder layer reaches on ``path``, and whether it is
    this profile's own measurement (``slideformer bench --hardware``) rather than
    LAYER_EFFICIENCY's reference figure."""
    measured = dict(hw.layer_efficiency).get(path.key)
    return (measured, True) if measured else (LAYER_EFFICIENCY[path.key], False)


def kernels_note(path: KernelPath, hw: HardwareProfile, irr: "Irregular | None" = None) -> str:
    """The kernel path a CUDA plan assumes, in words, e.g. "fused Triton + FlexAttention
    (document BlockMask), measured 0.81 of the matmul peak"; with ``irr``, the layer parts timed
    by measurement instead (:func:`irregular`)."""
    eff, measured = layer_efficiency(path, hw)
    note = f"{path.describe()}, {'measured' if measured else 'assumed'} {eff:.2f} of the matmul peak"
    timed = [what for what, on in (("routed experts", irr and irr.expert_flops),
                                   ("the gated delta rule (PyTorch)", irr and irr.rule_flops),
                                   (f"attention of heads over {FLASH_HEAD_DIM} (SDPA's math path)",
                                    irr and irr.score_flops),
                                   ("per-head norms in " + ("the fused kernel" if irr and
                                     irr.norms_fused else "PyTorch ops"),
                                    irr and irr.norm_elements))
             if on]
    if timed:
        note += f"; {' and '.join(timed)} at their times measured on an H100, scaled by matmul rate"
    if irr and irr.flash_flops:
        note += (f"; attention at {FLASH_ATTENTION_RATE:.2f} of the matmul rate (fitted to a "
                 "measured long-sequence step)")
    return note


def cpu_dispatch_s(layers: int, n_micro: int) -> float:
    """Fixed op costs of one CPU-backend step: forward, recompute and backward of every layer."""
    return 3 * layers * n_micro * CPU_OPS_PER_PASS * CPU_OP_S

SERIAL = 1.15
"""A step this much longer than its busiest resource means resources wait for each other."""
RESOURCES = ("gpu compute", "pcie h2d", "pcie d2h", "cpu optimizer", "disk")


@dataclass(frozen=True)
class SpeedEstimate:
    """Predicted time of one optimizer step and what bounds it."""
    step_time: float
    """Seconds per optimizer step."""
    tokens_per_s: float
    bound: str
    """The resource with the most work per step (one of RESOURCES)."""
    busy: tuple[tuple[str, float], ...]
    """Seconds of work per step on each resource."""
    flops: float
    """FLOPs per step, recompute included."""
    note: str = ""
    """Why the step is longer than its busiest resource, when it is."""
    kernels: str = ""
    """The GPU kernel path the layers' compute assumes (kernels_note); "" on the CPU backend."""
    rollout_s: float = 0.0
    """GRPO: seconds of sampling before each step (:func:`rollout_time`); 0: none or unknown."""

    def busy_dict(self) -> dict[str, float]:
        return dict(self.busy)


DECODE_LAYER_S = {"full": 2.7e-3, "lora": 2.7e-3, "qlora": 5.8e-3}
"""Seconds a decode step spends in each decoder layer, for any number of rows up to a few dozen:
GRPO's sampling of one token is launch-bound in eager PyTorch, not bound by the weights' bytes.
Measured on an H100 with a 16-core Xeon (benchmarks/grpo_rollouts.py, Llama-3.1-8B shape, a
group of 8 rows, 128 new tokens, 2026-12-07): 86 ms a step with the model resident in bf16
(full), 185 ms through a QLoRA window with the NF4 base resident (each layer dequantised every
step). LoRA's bf16 window is assumed to cost what the resident model does (not measured)."""


def rollout_time(spec: ModelSpec, method: str, prompts: int, together: int, new_tokens: int,
                 prompt_tokens: int, rate: float) -> float:
    """GRPO's sampling before a step: ``prompts`` prompts, ``together`` of them decoded in one
    batch (grpo.sample_groups) for up to ``new_tokens`` steps of :data:`DECODE_LAYER_S` a
    layer, each prompt's prefill one forward of ``prompt_tokens`` tokens at ``rate`` FLOP/s.
    An upper bound on the decode (replies that stop early end their batch sooner)."""
    L = spec.num_layers
    batches = -(-prompts // max(1, together))
    prefill = prompts * (L * DECODE_LAYER_S[method]
                         + 2.0 * spec.active_params * prompt_tokens / rate)
    return batches * new_tokens * L * DECODE_LAYER_S[method] + prefill


def _pipeline(n: int, stages: list[float]) -> float:
    return n * max(stages) + sum(stages) - max(stages)


def layer_flops(spec: ModelSpec, shape: ExecShape) -> tuple[float, float]:
    """(forward, recompute + backward) FLOPs of one decoder layer over all micro-batches."""
    B, T, n = shape.micro_batch, shape.seq_len, shape.n_micro
    lin = 2.0 * spec.active_params_per_layer * B * T  # a token computes with its experts only
    att = mixer_flops(spec, B, T)
    return n * (lin + att), n * (3 * lin + 3 * att)


DELTANET_CHUNK = 64
"""Tokens per chunk of the gated delta rule (models.deltanet.CHUNK, fla's)."""


def mixer_flops(spec: ModelSpec, B: int, T: int) -> float:
    """Forward FLOPs of the token mixing beyond the projections, per layer on average: softmax
    attention's QK^T and PV (2 B T^2 over the query width, half masked; the widest layer's),
    and in a hybrid the gated DeltaNet layers' share: per token and value head, the chunked
    rule's in-chunk products 2 C (d_k + d_v) and its state's three d_k x d_v products."""
    L = spec.num_layers
    linear = sum(spec.is_linear(i) for i in range(L))
    att = 2.0 * B * T * T * spec.q_width * (L - linear) / L
    if linear:
        d = spec.linear
        per_token = d.num_v_heads * (2 * DELTANET_CHUNK * (d.head_k_dim + d.head_v_dim)
                                     + 6 * d.head_k_dim * d.head_v_dim)
        att += B * T * per_token * linear / L
    return att


IRREGULAR_REFERENCE_TFLOPS = 783.0
"""The 8192^3 bf16 matmul rate of the H100 80GB HBM3 on which EXPERT_PAIR_S and DELTANET_RULE_S
were measured (benchmarks/family_layers.py, 2026-12-07); another GPU's times are scaled by its
rate against this one."""
EXPERT_PAIR_S = {False: 38e-12, True: 123e-12}
"""Seconds of a mixture's routed experts in the forward, per (token, expert) pair and element
of the hidden state, keyed by whether the stacked experts are stored (E, in, out) (GPT-OSS) rather
than (E, out, in). Routing, the gather, three grouped products (``F.grouped_mm``), the
activation and the weighted scatter: their time on an H100 did not follow the experts' FLOPs
but the pairs times the hidden size (benchmarks/family_layers.py, 4 x 1024 tokens, 2026-12-07:
Qwen3-30B-A3B 37.7, OLMoE-1B-7B 37.5, Qwen3.5-35B-A3B 40.5 ps with expert widths of 768, 1024
and 512, i.e. 0.10-0.21 of the matmul rate by FLOPs; GPT-OSS-120B 123 ps)."""
EXPERT_PASSES = {"fwd": 1.0, "frozen": 2.0, "full": 2.5}
"""The experts' recompute + backward against their forward: dL/dx only (a frozen base) 1.98-2.2x
on the same four shapes; with every weight gradient the layer's backward grew by 0.4-0.74 of the
experts' forward more (the attention projections' gradients included, which the FLOP-timed
part counts too: 2.5 errs a little high)."""
DELTANET_RULE_S = {"fwd": 51e-9, "frozen": 187e-9, "full": 187e-9}
"""Seconds of the gated delta rule on the PyTorch chunked path (models.deltanet, where fla does
not run: deltanet_gpu.fla_usable), the causal convolution and gated norm included, per token
and value head of 128 x 128, forward and recompute + backward (its only weights are vectors):
51 and 187 ns on both Qwen3.5 shapes (benchmarks/family_layers.py, H100, 2026-12-07). Scaled
by d_k d_v for other head sizes. Through fla the rule's FLOPs are counted at the layer rate."""


@dataclass(frozen=True)
class Irregular:
    """The parts of a decoder layer timed by measurement instead of FLOPs at the layer rate,
    per micro-batch and averaged over the layers: the routed experts', the PyTorch delta
    rule's and the math-path attention's forward FLOPs (left out of the FLOP-timed work) and
    their seconds per pass."""
    expert_flops: float = 0.0
    rule_flops: float = 0.0
    fwd: float = 0.0
    frozen: float = 0.0
    full: float = 0.0
    score_flops: float = 0.0
    flash_flops: float = 0.0
    norm_elements: float = 0.0
    """Per-head normed elements per micro-batch and layer (HEAD_NORM_S), in fwd/frozen/full."""
    norms_fused: bool = False
    """Those norms run in the fused Triton kernel (HEAD_NORM_FUSED_S)."""

    def flops(self, frozen: bool) -> tuple[float, float]:
        """(forward, recompute + backward) FLOPs these parts stand for in layer_flops' count."""
        e, r = self.expert_flops, self.rule_flops + self.score_flops + self.flash_flops
        return e + r, (2 * e if frozen else 3 * e) + 3 * r


def fla_runs(device: str) -> bool:
    """Whether a CUDA run here would take fla's gated delta rule (kernels.deltanet_gpu)."""
    from slideformer.engine.kernels import deltanet_gpu
    if device != "cuda" or deltanet_gpu._chunk_rule() is None:
        return False
    return not (torch.cuda.is_available() and deltanet_gpu.fla_refused_on(0))


SCORE_S = {"fwd": 29e-12, "frozen": 61e-12, "full": 61e-12}
"""Seconds per attention score (batch x heads x T x T) on SDPA's math path with its matmuls on
TF32 (kernels.attention.wide_attention), forward and recompute + backward: Gemma-4 31B's
full-attention layers (32 heads of 512, 4 x 1024 tokens; benchmarks/family_layers.py, H100,
2026-12-07 eighth session): their mixer took 7.07 ms forward and 15.43 ms for the recompute +
backward, less the projections at the layer rate (2.46 and 4.92 ms) and the fused norms at
HEAD_NORM_FUSED_S (0.68 and 2.24 ms). Before TF32 (fp32 on the SIMT cores) the same fit gave
78 and 208 ps."""


FLASH_ATTENTION_RATE = 0.42
"""The attention kernels' rate on CUDA as a share of the matmul rate, forward and recompute +
backward counted as 1 + 3 times the causal forward's FLOPs (mixer_flops); the rest of a layer
keeps the path's efficiency. Fitted to one step: Llama-3.1-70B QLoRA, one 65,536-token sequence,
tiles of 4096 queries on SDPA's flash kernel, H100 under a 24 GiB cap (benchmarks/RESULTS.md,
2026-12-07 sixth session). The GPU was busy 122.1 s; the plan (H100 preset, 759 TFLOP/s, 0.80
layer efficiency) put the rest of the step at 50.9 s, leaving 71.3 s for 2.25e16 FLOPs of
attention: 316 TFLOP/s, 0.42 of 759. The residual also holds what the plan does not model (the
dequantisation and adapters beyond their terms, the keys' second pass). Applied to FlexAttention
and the boolean-mask path too, where it was not measured; at 1K-token rows attention is a few %
of a layer and the path efficiencies (measured on whole layers) already hold some of it, so
those plans err ~3% slow."""


HEAD_NORM_S = {"fwd": 24e-12, "frozen": 93e-12, "full": 93e-12}
"""Seconds per element of the per-head q, k and value norms, forward and recompute + backward,
where the family's norms run as PyTorch ops in fp32 (models.layers.rms_norm with an offset or
fp32 scaling: Gemma 3 and 4, Qwen3.5) on the PyTorch-op kernel path; the fused Triton norm has
taken them since 2026-12-07 (eighth session): HEAD_NORM_FUSED_S. What Gemma-4
31B's sliding layer's mixer (32 query heads and 16 KV heads of 256, 4 x 1024 tokens; H100,
benchmarks/RESULTS.md 2026-12-07 seventh session) took beyond its projections at the layer rate
and flash attention at FLASH_ATTENTION_RATE: 1.63 ms forward and 6.21 ms recompute + frozen
backward over 16,384 normed elements a token. Of those 7.8 ms the profile showed 3.5 ms in
elementwise kernels and copies among the mixer's eight largest kernels; the rest is not
attributed. Counted for every attention layer: the math path's SCORE_S was fitted with its
layers' norms taken out."""


HEAD_NORM_FUSED_S = {"fwd": 8e-12, "frozen": 27e-12, "full": 27e-12}
"""HEAD_NORM_S where the fused Triton norm takes those norms: the same sliding layer's mixer
(H100, eighth session) took 2.49 ms forward and 5.90 ms recompute + frozen backward, 0.54 and
1.79 ms beyond its projections at the layer rate and flash attention at FLASH_ATTENTION_RATE,
over the same 16,384 normed elements a token (the norm kernels themselves: 0.23 ms forward,
0.50 ms backward; the rest, the casts and the heads' layout, is not attributed)."""


def _head_norm_elements(spec: ModelSpec, layers: list[int]) -> float:
    """Per-head normed elements a token, averaged over all layers, of ``layers``: q and k (and
    v with a value norm) where the family normalises each head with an offset or in fp32
    (HEAD_NORM_S on the PyTorch-op path, HEAD_NORM_FUSED_S on the fused one)."""
    fam = spec.family
    if fam.qk_norm != "head" or not (fam.norm_offset or fam.norm_fp32):
        return 0.0
    total = 0
    for i in layers:
        hd, kv = spec.head_dim_of(i), spec.kv_heads_of(i)
        total += hd * (spec.num_heads + kv * (1 + fam.v_norm))
    return total / spec.num_layers


def irregular(spec: ModelSpec, B: int, T: int, hw: HardwareProfile, device: str,
              fused: bool = False) -> Irregular:
    """A CUDA layer's routed experts, PyTorch delta rule and attention: flash at its own rate
    (:data:`FLASH_ATTENTION_RATE`), heads too wide for it on the math path, and Gemma's and
    Qwen3.5's per-head norms, in the fused kernel with ``fused`` (:class:`Irregular`)."""
    if device != "cuda":
        return Irregular()
    linear = sum(spec.is_linear(i) for i in range(spec.num_layers))
    wide = [i for i in range(spec.num_layers)
            if not spec.is_linear(i) and spec.head_dim_of(i) > FLASH_HEAD_DIM]
    flash = spec.num_layers - linear - len(wide)
    f_flops = 2.0 * B * T * T * spec.q_width * flash / spec.num_layers  # as mixer_flops counts
    f_s = f_flops / (FLASH_ATTENTION_RATE * hw.matmul_tflops * 1e12)
    normed = B * T * _head_norm_elements(
        spec, [i for i in range(spec.num_layers) if not spec.is_linear(i)])
    per = HEAD_NORM_FUSED_S if fused else HEAD_NORM_S
    n_fwd, n_frozen, n_full = (normed * per[k] * IRREGULAR_REFERENCE_TFLOPS
                               / hw.matmul_tflops for k in ("fwd", "frozen", "full"))
    if spec.moe is None and not linear and not wide:
        return Irregular(fwd=f_s + n_fwd, frozen=3 * f_s + n_frozen, full=3 * f_s + n_full,
                         flash_flops=f_flops, norm_elements=normed, norms_fused=fused)
    L, N, scale = spec.num_layers, B * T, IRREGULAR_REFERENCE_TFLOPS / hw.matmul_tflops
    e_flops = fwd = frozen = full = r_flops = 0.0
    m = spec.family.moe
    if spec.moe is not None:
        k, E = spec.moe.top_k, spec.moe.experts
        for lay in spec.layouts:
            if m.router not in lay.names():
                continue
            stacked = sum(math.prod(sh) for n, _, sh in lay.entries
                          if n.startswith(m.experts + ".") and len(sh) == 3)
            e_flops += 2.0 * stacked * k / E * N / L
            t = N * k * spec.hidden_size * EXPERT_PAIR_S[bool(m.gpt_oss)] * scale / L
            fwd += t
            frozen += t * EXPERT_PASSES["frozen"]
            full += t * EXPERT_PASSES["full"]
    if linear and not fla_runs(device):
        d = spec.linear
        r_flops = N * d.num_v_heads * (2 * DELTANET_CHUNK * (d.head_k_dim + d.head_v_dim)
                                       + 6 * d.head_k_dim * d.head_v_dim) * linear / L
        th = N * d.num_v_heads * d.head_k_dim * d.head_v_dim / (128 * 128) * scale * linear / L
        fwd += th * DELTANET_RULE_S["fwd"]
        frozen += th * DELTANET_RULE_S["frozen"]
        full += th * DELTANET_RULE_S["full"]
    fwd, frozen, full = fwd + f_s + n_fwd, frozen + 3 * f_s + n_frozen, full + 3 * f_s + n_full
    s_flops = 0.0
    if wide:  # mixer_flops counts every attention layer at the widest layer's query width
        s_flops = 2.0 * B * T * T * spec.q_width * len(wide) / L
        scores = B * spec.num_heads * T * T * scale * len(wide) / L
        fwd += scores * SCORE_S["fwd"]
        frozen += scores * SCORE_S["frozen"]
        full += scores * SCORE_S["full"]
    return Irregular(e_flops, r_flops, fwd, frozen, full, s_flops, f_flops, normed, fused)


@dataclass(frozen=True)
class _Times:
    """Seconds of each kind of work: per layer (forward / recompute+backward compute, CPU update,
    H2D load in the forward / on average in the backward, D2H of its fp32 grads and of its host
    checkpoints) and once per step (LM head, embedding and head updates, their H2D refreshes and
    the D2H of their grads)."""
    f: float
    b: float
    head: float
    upd: float
    load_f: float
    load_b: float
    grad: float
    ck_d2h: float
    reload: float
    """H2D of one layer's weights and host checkpoints again (pass 2 of regenerated layers)."""
    embed_upd: float
    head_upd: float
    refresh_e: float
    refresh_h: float
    grads_eh: float


def _times(spec: ModelSpec, shape: ExecShape, prec: Precision, hw: HardwareProfile,
           disk: float, efficiency: float, fused: bool) -> _Times:
    L, P, c, k = spec.num_layers, spec.params_per_layer, prec.c, max(1, min(shape.slots, spec.num_layers))
    E, Hd = spec.embed_layout.numel, spec.head_layout.numel
    f_fwd, f_bwd = layer_flops(spec, shape)
    tokens = shape.micro_batch * shape.seq_len * shape.n_micro
    plain = plain_layer(spec, dict.fromkeys(spec.largest_layout.names()))
    f_fwd = f_fwd - fp8_saving(spec, tokens, 1, prec)
    f_bwd = f_bwd - fp8_saving(spec, tokens, 2, prec, skip_down=plain)
    rate = hw.matmul_tflops * 1e12 * efficiency
    irr, n = irregular(spec, shape.micro_batch, shape.seq_len, hw, "cuda", fused), shape.n_micro
    i_fwd, i_bwd = irr.flops(frozen=False)
    tokens = shape.micro_batch * shape.seq_len * shape.n_micro
    one, both = hw.h2d_gbs * 1e9, hw.duplex_gbs * 1e9
    host_ck = shape.checkpoints == "host"
    ck = tokens * spec.hidden_size * prec.r if host_ck else 0  # one layer's checkpoints
    u = UPDATE_CONTENTION * update_s(prec, hw)
    head_rate = hw.matmul_tflops * 1e12 * HEAD_EFFICIENCY
    head = 6.0 * tokens * spec.vocab_size * spec.hidden_size / head_rate
    return _Times(f=(f_fwd - n * i_fwd) / rate + n * irr.fwd,
                  b=(f_bwd - n * i_bwd) / rate + n * irr.full, head=head,
                  upd=max(P * u, disk / L), load_f=P * c / (both if host_ck else one),  # D2H busy only for host checkpoints
                  load_b=((L - k) / L) * P * c / both + ck / both, grad=P * 4 / both, ck_d2h=ck / both,
                  reload=P * c / both + ck / both,
                  embed_upd=E * u, head_upd=Hd * u, refresh_e=E * c / one, refresh_h=Hd * c / one,
                  grads_eh=(E + Hd) * 4 / both)


def _speculation(S: int, t: _Times) -> float:
    """End (from the backward's start) of the S speculative updates: the i-th of them follows
    its layer's gradient copy and the update before it."""
    stage, end = max(t.load_b, t.b, t.grad), 0.0
    for i in range(S):
        end = max(end, (i + 1) * stage + t.grad) + t.upd
    return end


def _forward(L: int, k: int, ready: list[float], t0: float, t: _Times, G: int = 0) -> float:
    """End of the forward, as SlidingExecutor.forward_window issues it (module docstring);
    layers below G are on the device (no load)."""
    host = h2d = d2h = prev = t0
    done, load_done = [0.0] * L, [t0] * G + [None] * (L - G)

    def load(j: int) -> None:
        nonlocal h2d
        slot_free = done[j - k] if j - k >= G else t0
        h2d = max(h2d, host, slot_free) + t.load_f
        load_done[j] = h2d

    for i in range(L):
        if load_done[i] is None:
            host = max(host, ready[i])  # _load waits for the layer's own pending update
            load(i)
        ahead = max(i + 1, G)
        for j in range(ahead, min(ahead + k - 1, L)):
            if load_done[j] is None and ready[j] <= host:  # _prefetch: finished updates only
                load(j)
        start = max(prev, load_done[i])
        d2h = max(d2h, start) + t.ck_d2h  # host checkpoints: the layer's inputs leave at its start
        prev = done[i] = start + t.f
    return max(prev, d2h)


def estimate(spec: ModelSpec, shape: ExecShape, prec: Precision, device: str, clip: bool,
             hw: HardwareProfile, disk_layers: int = 0, packed: bool = True) -> SpeedEstimate:
    """Step time, tokens/s and the bounding resource of one optimizer step (``packed``:
    micro-batches of packed documents, whose attention takes a document mask)."""
    L, k = spec.num_layers, max(1, min(shape.slots, spec.num_layers))
    tokens = shape.micro_batch * shape.seq_len * shape.n_micro
    f_fwd, f_bwd = layer_flops(spec, shape)
    R = len(regen_layers(L, shape.device_layers, shape.regen_layers)) if clip else 0
    flops = L * f_fwd + (L + R) * f_bwd + 6.0 * tokens * spec.vocab_size * spec.hidden_size
    moved = disk_layers * file_bytes(spec.params_per_layer, prec.compute, prec.moments)
    disk = moved / (hw.disk_read_gbs * 1e9) + moved / (hw.disk_write_gbs * 1e9)
    if device != "cuda":
        return _cpu_estimate(spec, shape, prec, hw, tokens, flops, disk, R)
    path = kernel_path(device, spec.max_head_dim, packed)
    t = _times(spec, shape, prec, hw, disk, layer_efficiency(path, hw)[0], path.fused_ops)
    G, E, Hd = min(shape.device_layers, L), spec.embed_layout.numel, spec.head_layout.numel
    on_device = G * spec.params_per_layer + (E + Hd if shape.device_update else 0)
    dev_upd = on_device * DEVICE_ADAM_BYTES / (DEVICE_MEMORY_GBS * 1e9)
    if shape.device_update:  # no CPU update, refresh or gradient copy for embed and head
        t = replace(t, embed_upd=0.0, head_upd=0.0, refresh_e=0.0, refresh_h=0.0, grads_eh=0.0)
    S = len(speculative_layers(L, G, shape.spec_layers,
                               nvme_layers(L, disk_layers) + regen_layers(L, G, R))) if clip else 0
    regen = _pipeline(R, [t.reload, t.b, t.grad, t.upd]) if R else 0.0
    if clip:  # updates embed, G .. L-1, head from the step's start, overlapping the forward
        ready, chain = [0.0] * L, t.embed_upd
        for j in range(G + R, L - S):  # the speculative (last S) and regenerated layers: done
            chain += t.upd
            ready[j] = chain
        fwd_end = _forward(L, k, ready, dev_upd + t.embed_upd + t.refresh_e, t, G)
        head_ready = max(ready + [t.embed_upd]) + t.head_upd + t.refresh_h
        bwd = max(_pipeline(L - G, [t.load_b, t.b, t.grad]), _speculation(S, t)) + G * t.b
        bwd += regen
    else:  # each layer's update follows its grads in the backward; the embedding's comes last
        fwd_end = _forward(L, k, [0.0] * L, dev_upd + t.embed_upd + t.refresh_e, t, G)
        head_ready = t.embed_upd + t.head_upd + t.refresh_h
        bwd = _pipeline(L - G, [t.load_b, t.b, t.grad, t.upd]) + G * t.b
    step = max(fwd_end, head_ready) + t.head + bwd + t.grads_eh
    busy = {"gpu compute": (L + R) * t.b + L * t.f + t.head + dev_upd,
            "pcie h2d": (L - G) * (t.load_f + t.load_b) + R * t.reload
                        + t.refresh_e + t.refresh_h,
            "pcie d2h": (L - G) * t.grad + L * t.ck_d2h + t.grads_eh,
            "cpu optimizer": (spec.num_params - on_device) * UPDATE_CONTENTION * update_s(prec, hw),
            "disk": disk}
    note = ""
    if step > SERIAL * max(busy.values()):
        note = ("the forward waits for the CPU updates (exact clipping), so the optimizer and "
                "the GPU take turns" if clip else
                "the pipeline fills and drains: resources wait for each other")
    irr = irregular(spec, shape.micro_batch, shape.seq_len, hw, device, path.fused_ops)
    return replace(_result(step, tokens, busy, flops, note), kernels=kernels_note(path, hw, irr))


def _cpu_estimate(spec, shape, prec, hw, tokens, flops, disk, regen: int = 0) -> SpeedEstimate:
    """The CPU backend is synchronous: compute, copies and updates add up (``regen``
    regenerated layers: their recompute, backward and load once more)."""
    L, P, c = spec.num_layers, spec.params_per_layer, prec.c
    E, Hd = spec.embed_layout.numel, spec.head_layout.numel
    copies = (2 * L * P * c + L * P * 4 + regen * P * c + (E + Hd) * (c + 4)) / (CPU_COPY_GBS * 1e9)
    compute = (flops / (hw.cpu_tflops * 1e12) + cpu_dispatch_s(L, shape.n_micro)
               + 2 * cpu_dispatch_s(regen, shape.n_micro) / 3)
    busy = {"gpu compute": compute, "pcie h2d": copies, "pcie d2h": 0.0,
            "cpu optimizer": spec.num_params * update_s(prec, hw), "disk": disk}
    return _result(sum(busy.values()), tokens, busy, flops, "CPU backend: nothing overlaps")


def _result(step: float, tokens: int, busy: dict[str, float], flops: float, note: str) -> SpeedEstimate:
    step = max(step, max(busy.values()))
    bound = max(RESOURCES, key=lambda r: busy[r])
    return SpeedEstimate(step, tokens / step, bound, tuple((r, busy[r]) for r in RESOURCES), flops, note)
