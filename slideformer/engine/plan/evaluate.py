"""Memory evaluation of one set of settings, and the executor shape the planner picks for it.

- checkpoints: on the GPU or in pinned host memory; ``auto`` takes whichever fits with the
  higher predicted throughput (GPU when both are equal: no extra PCIe traffic);
- K parameter slots: as many as fit the budgets with 10% to spare, at least 2, at most the
  layer count;
- head_chunk: tokens per LM-head chunk, the largest power of two up to 4096 whose fp32 logits
  stay within 512 MiB (a 1024 x 128k-vocab chunk already runs the GEMM at full speed);
- NVMe tier (with a disk budget): when the host state exceeds the RAM budget less DISK_MARGIN
  (with a disk budget every host-RAM choice below keeps within that: :meth:`Evaluator._host_limit`),
  the moments of the fewest decoder layers that bring it within go to disk (every disk layer
  costs a read and a write per step; a host within that limit is left alone, "tight" or not).
  The first layers moved save nothing while
  each still gets its own staging buffer (slideformer.engine.runtime.nvme.BUFFERS of them). With a
  frozen base (lora, qlora) the same search moves the base weights of the fewest layers
  (read once or twice per step, never written; slideformer.engine.plan.frozen).
- device optimizer (CUDA, no NVMe tier): with VRAM to spare, the embedding and head, and then
  as many first decoder layers as keep the budgets' last 10% free, hold their master weights and
  moments on the GPU and are updated there (at most DEVICE_SLOTS slots then: spare VRAM buys
  more as device layers than as slots); taken when the speed model predicts a faster step.
- speculative layers (exact clipping): the last decoder layers updated on the host update in
  the backward and keep their pre-update state in a second set of buffers
  (slideformer.engine.runtime.grad_ring: 12 B/param of host RAM each, no CPU time). Of the counts that
  keep host RAM 10% free, the fewest whose predicted speed is within SPEC_GAIN of the best's
  (the barrier's updates left must fit in the next forward; more buy nothing); at least
  SPEC_LAYERS, which are dropped first when host RAM is short, before any layer goes to the NVMe
  tier. The search runs only without regenerated layers or an NVMe tier: those mean RAM is short.
- regenerated layers (exact clipping, ``train.clip_regen = auto``): when host RAM is still short
  without speculation, the fewest lowest layers whose gradient a second backward pass
  regenerates (slideformer.engine.runtime.regen: 4 B/param of host gradient buffer less each) that
  bring it within the budget; only when even all of them do not suffice does the NVMe tier
  take over (without regeneration: a regenerated layer cannot be in the tier).
- GPU checkpoints of the top layers (host checkpoints): when host RAM is still short with
  every layer regenerated (or without regeneration: no clipping, a frozen base), the fewest top
  layers whose checkpoints stay on the GPU (0.5 GiB a layer for an 8B at
  64K tokens a step) that bring it within the budget, if VRAM keeps within its own; before the
  NVMe tier. The speed model still counts every layer's checkpoint copies (a few ms a layer).
Slots, checkpoints, gpu_layers and clip_regen set in the config override the choice.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.plan.budget import Budgets
from slideformer.engine.plan.frozen import frozen_allocations, frozen_estimate
from slideformer.engine.plan.hardware import HardwareProfile
from slideformer.engine.plan.memory import (Allocation, Precision, allocations, peak, peak_phase,
                                           rollout_allocations)
from slideformer.engine.plan.speed import SpeedEstimate, estimate
from slideformer.engine.runtime.shapes import ExecShape, ff_tile, speculative_layers

TIGHT = 0.9
"""A budget used above this share is "tight"."""
HEAD_LOGITS_CAP = 512 << 20
DEVICE_SLOTS = 4
SPEC_LAYERS = 4
"""Speculative layers with clipping at least (while host RAM fits them): their second buffers
hold 12 B/param more than the barrier's gradient buffers (4 Llama-3.2-3B layers: 4.8 GB) and
move 4 layers' CPU updates from the next forward into the backward."""
SPEC_GAIN = 0.99
"""More speculative layers are taken while they lift the predicted speed above this share of
the best that fit would give (the best of SPEC_GRID + 1 evenly spaced counts)."""
SPEC_GRID = 6
MAX_SEARCH = 1 << 16
DISK_MARGIN = 0.02
"""Share of the RAM budget the NVMe tier's search leaves free: a user who names a RAM budget for
a model that only fits with the tier treats it as a hard limit, and the plan's own error is of
this order (the 123B QLoRA at ``--ram 64``: planned 63.98 GiB, measured VmHWM 64.01 GiB,
benchmarks/RESULTS.md 2026-12-07 seventh session)."""


@dataclass(frozen=True)
class Knobs:
    """The settings the planner varies when it searches for batches and fixes."""
    seq_len: int
    micro_batch: int
    grad_accum: int
    precision: Precision
    slots: int = 0
    """0: as many as fit."""
    checkpoints: str = "auto"
    """auto, gpu or host."""
    clip: bool = True
    """Exact global-norm clipping (updates overlap the next forward instead of the backward)."""
    packed: bool = True
    """Packed sequences (attention masks exist)."""
    disk_layers: int | None = None
    """Layers whose moments the NVMe tier holds; None: as many as host RAM needs (0 without a
    disk budget)."""
    gpu_layers: int = -1
    """Decoder layers updated on the device (with the embedding and head); -1: the planner's
    choice, 0: none."""
    method: str = "full"
    """full, lora or qlora (train.method): with lora / qlora the base is frozen."""
    lora: object = None
    """The adapters' slideformer.engine.models.lora.LoraSpec (lora, qlora)."""
    regen: int | None = None
    """Regenerated layers with clipping (train.clip_regen); None: the planner's choice."""
    rollout: int = 0
    """GRPO (train.objective): the replies decoded together between steps (grpo.group_size x
    grpo.prompts_together), by the model made resident (full) or through the window (lora,
    qlora): memory.rollout_allocations; 0: no sampling."""
    rollout_tokens: int = 0
    """KV-cache positions of a rollout row (planner.rollout_tokens); 0: seq_len."""
    rollout_group: int = 0
    """GRPO's group size: ``rollout`` is rollout_group x the prompts decoded together."""
    rollout_new_tokens: int = 0
    """GRPO's longest reply (grpo.max_new_tokens): the decode steps of a batch of prompts."""
    speculate: bool = True
    """Speculative layers with clipping; False: a rank of a data-parallel run, which has none
    (slideformer.engine.dist.ranks.rank_shape)."""


@dataclass(frozen=True)
class TierUse:
    """Predicted peak of one tier against its budget."""
    tier: str
    peak: int
    budget: int | None
    phase: str
    """When the peak happens: setup, forward, head or backward."""

    @property
    def share(self) -> float | None:
        return None if not self.budget else self.peak / self.budget


def head_chunk(vocab: int) -> int:
    """Tokens per LM-head chunk (see the module docstring)."""
    chunk = 4096
    while chunk > 128 and chunk * vocab * 4 > HEAD_LOGITS_CAP:
        chunk //= 2
    return chunk


@dataclass(frozen=True)
class Evaluation:
    """One executor shape and what it holds."""
    shape: ExecShape
    allocs: tuple[Allocation, ...]
    tiers: tuple[TierUse, ...]
    fits: bool
    disk_layers: int = 0
    """Decoder layers whose moments the NVMe tier holds."""


class Evaluator:
    """Memory evaluations of one spec under fixed budgets and device."""

    def __init__(self, spec: ModelSpec, device: str, budgets: Budgets, hw: HardwareProfile):
        self.spec, self.device, self.budgets, self.hw = spec, device, budgets, hw

    def evaluate(self, k: Knobs, shape: ExecShape) -> Evaluation:
        """The evaluation of ``shape``, without speculative layers if their snapshots would not
        fit in host RAM."""
        # what the searches below choose starts from none (a shape passed on from another
        # evaluation still carries its counts, which would skew their fits)
        shape = replace(shape, gpu_checkpoints=0,
                        regen_layers=shape.regen_layers if k.regen is not None else 0)
        if shape.spec_layers and self.budgets.ram:
            e = self._evaluate(k, shape, 0 if k.disk_layers is None else k.disk_layers)
            if e.tiers[1].peak > self._host_limit():
                shape = replace(shape, spec_layers=0)
        return self._placed(k, self._gpu_checkpoints(k, self._regenerated(k, shape)))

    def _regenerated(self, k: Knobs, shape: ExecShape) -> ExecShape:
        """``shape`` with the fewest regenerated layers that make host RAM fit (module
        docstring), the config's number, or none."""
        if not (k.clip and k.method == "full"):
            return shape
        if k.regen is not None:
            return replace(shape, regen_layers=k.regen)
        if not self.budgets.ram or k.disk_layers:
            return shape

        def fits(r: int) -> bool:
            return self._evaluate(k, replace(shape, regen_layers=r), 0).tiers[1].peak \
                <= self._host_limit()
        lo, hi = 1, self.spec.num_layers - min(shape.device_layers, self.spec.num_layers)
        if fits(0) or not hi:
            return shape
        if not fits(hi):  # the NVMe tier's turn; without one, the closest to fitting
            return shape if self.budgets.disk else replace(shape, regen_layers=hi)
        while lo < hi:  # RAM falls with more regenerated layers: the fewest that fit
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        return replace(shape, regen_layers=lo)

    def _gpu_checkpoints(self, k: Knobs, shape: ExecShape) -> ExecShape:
        """``shape`` with the fewest top layers' checkpoints on the GPU that bring host RAM
        within its budget while VRAM stays within its own (module docstring); none when host
        RAM fits without, or when even all of them would not do it (the NVMe tier's turn)."""
        shape = replace(shape, gpu_checkpoints=0)
        L = self.spec.num_layers
        if shape.checkpoints != "host" or not self.budgets.ram or k.disk_layers \
                or self.device != "cuda":  # on the CPU backend both are the same RAM
            return shape
        if k.clip and k.method == "full" and 0 < shape.regen_layers < L - min(
                shape.device_layers, L) or k.regen is not None and k.regen < L:
            return shape  # regenerated layers come first (fitted already, or the config's count)

        def at(g: int) -> tuple[bool, bool]:
            e = self._evaluate(k, replace(shape, gpu_checkpoints=g), 0)
            return e.tiers[1].peak <= self._host_limit(), _within(e.tiers[:1], 1.0)
        if at(0)[0] or not at(L)[0]:
            return shape
        lo, hi = 1, L
        while lo < hi:  # host RAM falls with every layer moved: the fewest that fit
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if at(mid)[0] else (mid + 1, hi)
        if not at(lo)[1]:
            return shape
        # all of them: the device store alone (no host copies, no staging layers)
        return replace(shape, checkpoints="gpu") if lo == L else replace(shape, gpu_checkpoints=lo)

    def _placed(self, k: Knobs, shape: ExecShape) -> Evaluation:
        """``shape`` with the NVMe tier the host budget needs (none beside regenerated layers)."""
        if shape.regen_layers and k.clip:
            return self._evaluate(k, shape, 0)
        if k.disk_layers is not None:
            return self._evaluate(k, shape, k.disk_layers)
        e = self._evaluate(k, shape, 0)
        target = self._host_limit()
        if not self.budgets.disk or e.tiers[1].peak <= target:
            return e

        def host_fits(n: int) -> bool:
            return self._evaluate(k, shape, n).tiers[1].peak <= target

        lo, hi = 1, self.spec.num_layers  # RAM falls with more layers on disk: the fewest that fit
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if host_fits(mid) else (mid + 1, hi)
        return self._evaluate(k, shape, lo)  # all layers when even that does not fit

    def _host_limit(self) -> int:
        """The host RAM the choices below keep within: the budget, less DISK_MARGIN of it
        where an NVMe tier may take what does not fit."""
        return int(self.budgets.ram * (1 - DISK_MARGIN)) if self.budgets.disk else self.budgets.ram

    def _evaluate(self, k: Knobs, shape: ExecShape, disk_layers: int) -> Evaluation:
        if k.method == "full":
            allocs = allocations(self.spec, shape, k.precision, self.device, k.packed, disk_layers,
                                 k.clip)
        else:
            allocs = frozen_allocations(self.spec, shape, k.precision, self.device, k.packed,
                                        k.method, k.lora, disk_layers)
        if k.rollout:
            allocs = (*allocs, *rollout_allocations(self.spec, k.precision,
                                                    k.rollout_tokens or k.seq_len, k.rollout,
                                                    window=k.method != "full"))
        gpu_t = ("gpu",)
        host_t = ("host",) if self.device == "cuda" else ("gpu", "host")
        tiers = (TierUse("gpu", peak(allocs, gpu_t), self.budgets.vram, peak_phase(allocs, gpu_t)),
                 TierUse("host", peak(allocs, host_t), self.budgets.ram, peak_phase(allocs, host_t)),
                 TierUse("disk", peak(allocs, ("disk",)), self.budgets.disk, "run"))
        return Evaluation(shape, allocs, tiers, _within(tiers, 1.0), disk_layers)

    def _shape(self, k: Knobs, slots: int, ckpt: str) -> ExecShape:
        dropout = k.lora.dropout if k.lora is not None else 0.0
        return ExecShape(micro_batch=k.micro_batch, seq_len=k.seq_len, n_micro=k.grad_accum,
                         slots=slots, checkpoints=ckpt, head_chunk=head_chunk(self.spec.vocab_size),
                         spec_layers=SPEC_LAYERS if k.clip and k.speculate else 0,
                         ff_tokens=ff_tile(self.spec, k.micro_batch * k.seq_len, dropout,
                                           k.micro_batch))

    def _most_slots(self, k: Knobs, ckpt: str) -> Evaluation:
        """As many slots as fit (at least 2, at most L) keeping the budgets' last 10% free, or
        the config's own number. More slots only spare backward re-fetches: they never take
        the headroom that would make a run "tight"."""
        L = self.spec.num_layers
        if k.slots:
            return self.evaluate(k, self._shape(k, min(k.slots, L), ckpt))
        lo, hi = min(2, L), L
        best = self.evaluate(k, self._shape(k, lo, ckpt))
        if not self._room(best.tiers):
            return best
        while lo < hi:  # memory grows with K: binary search the largest that fits
            mid = (lo + hi + 1) // 2
            e = self.evaluate(k, self._shape(k, mid, ckpt))
            if self._room(e.tiers):
                lo, best = mid, e
            else:
                hi = mid - 1
        return best

    def choose(self, k: Knobs) -> Evaluation:
        """The executor shape for these knobs (see the module docstring)."""
        options = ["gpu", "host"] if k.checkpoints == "auto" else [k.checkpoints]
        evals = [self._most_slots(k, ck) for ck in options]
        fitting = [self._speculative(k, self._device_items(k, e)) for e in evals if e.fits]
        if not fitting:
            return min(evals, key=lambda e: _overshoot(e.tiers))
        return max(fitting, key=lambda e: self.speed(k, e).tokens_per_s)

    def _device_items(self, k: Knobs, e: Evaluation) -> Evaluation:
        """``e`` with spare VRAM given to the device optimizer (module docstring)."""
        if k.method != "full" or k.gpu_layers == 0 or (
                k.gpu_layers < 0 and (self.device != "cuda" or e.disk_layers)):
            return e  # a frozen base has no optimizer state to place
        L = self.spec.num_layers
        slots = e.shape.slots if k.slots else min(e.shape.slots, DEVICE_SLOTS)

        def at(g: int) -> Evaluation:
            return self.evaluate(k, replace(e.shape, slots=slots, device_update=True, device_layers=g))
        if k.gpu_layers > 0:
            return at(min(k.gpu_layers, L))
        best = at(0)
        if not self._room(best.tiers):
            return e
        lo, hi = 0, L
        while lo < hi:  # VRAM grows with the device layers: the most that leave 10% free
            mid = (lo + hi + 1) // 2
            cand = at(mid)
            if self._room(cand.tiers):
                lo, best = mid, cand
            else:
                hi = mid - 1
        return best if self.speed(k, best).tokens_per_s > self.speed(k, e).tokens_per_s else e

    def _room(self, tiers) -> bool:
        """Room for a shape's slots and device layers: on CUDA they take VRAM, so the GPU keeps
        its last 10% free while the other tiers need only fit (a host made to fit by
        regenerated gradients is tight, and must not cost the run its slots); on the CPU
        backend, where they take host RAM too, every tier keeps 10% free."""
        if self.device != "cuda":
            return _within(tiers, TIGHT)
        return _within(tiers[:1], TIGHT) and _within(tiers[1:], 1.0)

    def _speculative(self, k: Knobs, e: Evaluation) -> Evaluation:
        """``e`` with the speculative layers that pay (module docstring)."""
        S = e.shape.spec_layers
        if not (S and k.clip and k.method == "full") or e.shape.regen_layers or e.disk_layers:
            return e
        L = self.spec.num_layers
        top = len(speculative_layers(L, e.shape.device_layers, L, []))

        def at(s: int) -> Evaluation:
            return self._evaluate(k, replace(e.shape, spec_layers=s), 0)

        def roomy(s: int) -> bool:  # they take host RAM only
            host = at(s).tiers[1]
            return host.budget is None or host.peak <= TIGHT * host.budget
        lo, hi = S, top
        while lo < hi:  # host RAM grows with them: the most that keep 10% free
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if roomy(mid) else (lo, mid - 1)
        if lo == S:
            return e
        speed = {}

        def tps(s: int) -> float:
            if s not in speed:
                speed[s] = self.speed(k, at(s)).tokens_per_s
            return speed[s]
        # the speed rises with them, then flattens (it may dip by a little at the very end):
        # the best of a coarse grid, climbed to its peak, then the fewest below it within
        # SPEC_GAIN of that
        grid = sorted({S + (lo - S) * i // SPEC_GRID for i in range(SPEC_GRID + 1)})
        best = max(grid, key=tps)
        for step in (1, -1):
            while S <= best + step <= lo and tps(best + step) > tps(best):
                best += step
        goal = SPEC_GAIN * tps(best)
        a, b = S, best
        while a < b:
            mid = (a + b) // 2
            a, b = (a, mid) if tps(mid) >= goal else (mid + 1, b)
        return at(a)

    def speed(self, k: Knobs, e: Evaluation) -> SpeedEstimate:
        if k.method != "full":
            return frozen_estimate(self.spec, e.shape, k.precision, self.device, self.hw,
                                   k.method, k.lora, k.packed, e.disk_layers)
        return estimate(self.spec, e.shape, k.precision, self.device, k.clip, self.hw, e.disk_layers,
                        k.packed)

    @staticmethod
    def largest(fits_at) -> int:
        """Largest n in [1, MAX_SEARCH] with fits_at(n), for a predicate true up to some n; 0 if none."""
        if not fits_at(1):
            return 0
        lo, hi = 1, 2
        while hi <= MAX_SEARCH and fits_at(hi):
            lo, hi = hi, 2 * hi
        if hi > MAX_SEARCH:
            return lo
        while hi - lo > 1:  # lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
        return lo


def _within(tiers, share: float) -> bool:
    return all(t.budget is None or t.peak <= share * t.budget for t in tiers)


def _overshoot(tiers) -> float:
    return max((t.peak / t.budget for t in tiers if t.budget), default=0.0)
