"""The planner: will a run fit, where does each byte go, how fast will it be, and how to fix it.

:func:`make_plan` takes a model spec, the run's settings, budgets and a hardware profile, and
returns a frozen :class:`Plan`. The plan also fixes the executor's shape (slideformer.engine.plan.evaluate
says how it is chosen); the Trainer runs with ``Plan.exec_shape`` as is, so the prediction and
the run cannot drift apart. :func:`plan_run` does the whole job from a RunConfig.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from slideformer.engine.config import RunConfig, format_bytes
from slideformer.engine.devices import (compute_dtype_name, device_kind, moments_torch_dtype,
                                        residual_dtype_name, torch_dtype)
from slideformer.engine.errors import UserError
from slideformer.engine.kernels import cpu_adam
from slideformer.engine.models.lora import for_model, lora_spec
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.plan.budget import Budgets, resolve_budgets
from slideformer.engine.plan.evaluate import SPEC_LAYERS, TIGHT, Evaluation, Evaluator, Knobs, TierUse
from slideformer.engine.plan.fixes import Fix, find_fixes, floor_notes
from slideformer.engine.plan.hardware import HardwareProfile
from slideformer.engine.plan.machine import gpu_memory, host_memory
from slideformer.engine.plan.memory import Allocation, Precision, peak
from slideformer.engine.plan.speed import SpeedEstimate, rollout_time
from slideformer.engine.plan.targets import load_profile
from slideformer.engine.runtime.shapes import ExecShape
from slideformer.engine.validate import validate

_TIER_NAMES = {"gpu": "GPU memory", "host": "host RAM", "disk": "NVMe disk"}


@dataclass(frozen=True)
class Plan:
    """Everything the planner predicts for a run (what the GUI's plan page draws)."""
    model_type: str
    total_params: int
    active_params: int
    """Parameters one token computes with (a mixture of experts: its routed experts only);
    memory counts the total, FLOPs these."""
    device: str
    """cuda, or cpu (then the "gpu" tier is host memory too)."""
    compute_dtype: str
    moments_dtype: str
    exec_shape: ExecShape
    """The executor shape the run uses (Trainer.exec_shape returns it)."""
    allocations: tuple[Allocation, ...]
    tiers: tuple[TierUse, ...]
    """Peaks of gpu, host and disk; on the CPU backend host includes the device buffers."""
    peak_rss: int
    """Predicted high-water resident memory of the process (VmHWM): the host tier's peak (on
    the CPU backend with the "device" buffers). The model files are read, never mapped, so no
    page of them counts (slideformer.engine.models.weights)."""
    budgets: Budgets
    verdict: str
    """fits, tight or does not fit."""
    reason: str
    fixes: tuple[Fix, ...]
    """Cheapest first; empty when the run fits with room to spare."""
    max_micro_batch: int
    """Largest micro-batch that fits (with this grad_accum); 0 when none does."""
    max_global_batch: int
    """Largest sequences per step: the micro-batch (or, if it does not fit, the largest that
    does) times the largest grad_accum that fits with it; 0 when nothing fits."""
    speed: SpeedEstimate
    hardware: HardwareProfile
    tokens_per_step: int
    notes: tuple[str, ...] = ()
    """What no single fix can change (the least each short tier needs)."""
    disk_layers: int = 0
    """Decoder layers whose AdamW moments (full) or frozen base weights (lora, qlora) live in
    the NVMe tier (slideformer.engine.runtime.shapes.disk_layers says which)."""
    method: str = "full"
    """full, lora or qlora (train.method)."""
    clipped_tokens_per_s: float | None = None
    """Tokens/s of a step whose gradient norm exceeds optim.max_grad_norm, where it is 2% or
    more below ``speed`` (which is for steps that do not clip): its speculative layers update
    after the barrier, as without speculation. None without clipping or speculative layers,
    for LoRA and QLoRA, or where the two are that close."""

    def tier(self, name: str) -> TierUse:
        return next(t for t in self.tiers if t.tier == name)

    def to_dict(self) -> dict:
        """JSON-ready figures (``slideformer plan --json``)."""
        d = dataclasses.asdict(self)
        d["speed"]["busy"] = self.speed.busy_dict()
        d["fixes"] = [dict(dataclasses.asdict(f), settings=dict(f.settings)) for f in self.fixes]
        return d


def _verdict(tiers: tuple[TierUse, ...], hardware: HardwareProfile) -> tuple[str, str]:
    """(verdict, reason): the plan's words, ending with the machine they are for."""
    on = f" on {hardware.name}"
    over = [t for t in tiers if t.budget is not None and t.peak > t.budget]
    if over:
        return "does not fit", "; ".join(
            f"{_TIER_NAMES[t.tier]} needs {format_bytes(t.peak)} of the {format_bytes(t.budget)} "
            f"budget (peak in the {t.phase})" for t in over) + on
    tight = [t for t in tiers if t.budget and t.peak > TIGHT * t.budget]
    if tight:
        return "tight", "; ".join(f"{_TIER_NAMES[t.tier]} at {t.share:.0%} of its budget "
                                  f"({format_bytes(t.peak)} of {format_bytes(t.budget)})"
                                  for t in tight) + on
    room = ", ".join(f"{format_bytes(t.budget - t.peak)} of {_TIER_NAMES[t.tier]}"
                     for t in tiers if t.budget and t.tier != "disk")
    return "fits", f"fits with {room} to spare" + on


def _max_batches(ev: Evaluator, k: Knobs) -> tuple[int, int]:
    m_max = ev.largest(lambda m: ev.choose(replace(k, micro_batch=m)).fits)
    m = k.micro_batch if k.micro_batch <= m_max else m_max
    if not m:
        return 0, 0
    n_max = ev.largest(lambda n: ev.choose(replace(k, micro_batch=m, grad_accum=n)).fits)
    return m_max, m * n_max


def make_plan(spec: ModelSpec, knobs: Knobs, device: str, budgets: Budgets,
              hardware: HardwareProfile) -> Plan:
    """The plan of one run.

    Args:
        knobs: the run's batch, precision and placement settings.
        device: ``cuda`` or ``cpu``: the backend the run uses.
    """
    ev = Evaluator(spec, device, budgets, hardware)
    knobs, base = _rollout_prompts(ev, knobs)
    verdict, reason = _verdict(base.tiers, hardware)
    share = 1.0 if verdict == "does not fit" else TIGHT
    short = tuple(t.tier for t in base.tiers if t.budget is not None and t.peak > share * t.budget)
    fixes = find_fixes(ev, base, knobs, short, share) if short else ()
    notes = floor_notes(ev, knobs, short) if verdict == "does not fit" else ()
    clipped = _clipped_speed(ev, knobs, base)
    notes += _speculation_note(ev, knobs, base) + _clipped_note(ev, knobs, base, clipped)
    m_max, g_max = _max_batches(ev, knobs)
    rss_tiers = ("host",) if device == "cuda" else ("gpu", "host")
    p = knobs.precision
    return Plan(model_type=spec.model_type, total_params=spec.num_params,
                active_params=spec.active_params, device=device,
                compute_dtype=str(p.compute).removeprefix("torch.") + (" (FP8 projections)"
                                                                      if p.fp8 else ""),
                moments_dtype=str(p.moments).removeprefix("torch."), exec_shape=base.shape,
                allocations=base.allocs, tiers=base.tiers,
                peak_rss=peak(base.allocs, rss_tiers), budgets=budgets,
                verdict=verdict, reason=reason, fixes=fixes, max_micro_batch=m_max,
                max_global_batch=g_max, speed=_with_rollout(ev, knobs, base, device),
                hardware=hardware,
                tokens_per_step=knobs.micro_batch * knobs.seq_len * knobs.grad_accum, notes=notes,
                disk_layers=base.disk_layers, method=knobs.method,
                clipped_tokens_per_s=clipped)


def _with_rollout(ev: Evaluator, k: Knobs, e: Evaluation, device: str) -> SpeedEstimate:
    """The step's speed estimate, with GRPO's sampling time on a GPU (speed.rollout_time)."""
    sp = ev.speed(k, e)
    if not k.rollout or device != "cuda":
        return sp
    G = k.rollout_group or k.rollout
    prompts = max(1, k.micro_batch * k.grad_accum // G)
    return replace(sp, rollout_s=rollout_time(
        ev.spec, k.method, prompts, e.shape.rollout_prompts, k.rollout_new_tokens,
        max(1, k.seq_len - k.rollout_new_tokens), ev.hw.matmul_tflops * 1e12))


def _rollout_prompts(ev: Evaluator, k: Knobs) -> tuple[Knobs, Evaluation]:
    """GRPO: the most prompts (at most grpo.prompts_together's, ``k.rollout`` rows) whose
    groups' KV caches fit decoded together, in the exec shape (one when none fits)."""
    if not k.rollout:
        return k, ev.choose(k)
    G = k.rollout_group or k.rollout
    for n in range(k.rollout // G, 0, -1):
        kn = replace(k, rollout=G * n, rollout_tokens=k.rollout_tokens if n > 1 else k.seq_len)
        e = ev.choose(kn)
        if e.fits or n == 1:
            return kn, replace(e, shape=replace(e.shape, rollout_prompts=n))
    raise AssertionError("unreachable")


def _speculation_note(ev: Evaluator, k: Knobs, e: Evaluation) -> tuple[str, ...]:
    """What the speculative layers beyond the minimum buy and cost (plan.evaluate._speculative)."""
    S = e.shape.spec_layers
    if S <= SPEC_LAYERS:
        return ()
    fewer = ev._evaluate(k, replace(e.shape, spec_layers=SPEC_LAYERS), e.disk_layers)
    snaps = lambda x: sum(a.bytes for a in x.allocs  # noqa: E731
                          if a.purpose == "speculative update snapshots")
    fast, slow = ev.speed(k, e).tokens_per_s, ev.speed(k, fewer).tokens_per_s
    return (f"{S} decoder layers update during the backward, before the clipping coefficient is "
            f"known (exact: the barrier redoes any it changes); their second state buffers take "
            f"{(snaps(e) - snaps(fewer)) / (1 << 30):.1f} GiB more host RAM than {SPEC_LAYERS} "
            f"would, for {fast / slow - 1:+.0%} tokens/s ({fast:,.0f} against {slow:,.0f})",)


def _clipped_speed(ev: Evaluator, k: Knobs, e: Evaluation) -> float | None:
    """Tokens/s of a step that clips, where it is 2% or more below the plan's: its speculative
    layers update after the barrier (those that already updated during the backward are
    redone there, and that wasted work overlapped the backward), so it runs as the same shape
    without speculation would. None without clipping or speculative layers, for a frozen base
    (no layer updates on the host), or where the two speeds are that close."""
    if not (k.clip and e.shape.spec_layers) or k.method != "full":
        return None
    fast = ev.speed(k, e).tokens_per_s
    slow = ev.speed(k, ev._evaluate(k, replace(e.shape, spec_layers=0), e.disk_layers)).tokens_per_s
    return slow if slow < 0.98 * fast else None


def _clipped_note(ev: Evaluator, k: Knobs, e: Evaluation, slow: float | None) -> tuple[str, ...]:
    """What a clipped step runs at (``_clipped_speed``)."""
    if slow is None:
        return ()
    fast = ev.speed(k, e).tokens_per_s
    return (f"a step whose gradient norm exceeds optim.max_grad_norm updates its "
            f"{e.shape.spec_layers} speculative layers after the clipping barrier (redoing the "
            f"updates they made during the backward) and runs at about {slow:,.0f} tokens/s "
            f"({slow / fast:.0%} of the plan's speed, which is for steps that do not clip)",)


# ---- from a run config --------------------------------------------------------------------------
_FILE_BYTES = {"float32": 4, "float64": 8}


def run_device(cfg: RunConfig, hardware: HardwareProfile) -> str:
    """cuda or cpu: ``train.device``, where ``auto`` means a GPU if the profile's machine has one."""
    return device_kind(cfg.train.device, bool(hardware.gpu))


def knobs_from_config(cfg: RunConfig, spec: ModelSpec, device: str) -> Knobs:
    """The planner's settings of a run config (one that slideformer.engine.validate accepts)."""
    t, o, b = cfg.train, cfg.optim, cfg.budget
    compute_name = compute_dtype_name(t.compute_dtype, device)
    compute = torch_dtype(compute_name)
    moments = moments_torch_dtype(o.moments_dtype)
    residual = torch_dtype(residual_dtype_name(t.precision, compute_name))
    prec = Precision(compute, moments, _FILE_BYTES.get(spec.torch_dtype, 2), residual,
                     fp8=t.precision == "fp8")
    pairs = t.objective not in ("sft", "grpo")  # a preference micro-batch: 2 rows a pair
    return Knobs(seq_len=cfg.data.max_seq_len, micro_batch=t.micro_batch * (1 + pairs),
                 grad_accum=t.grad_accum, precision=prec, slots=b.slots,
                 checkpoints=b.checkpoints, gpu_layers=b.gpu_layers, clip=o.max_grad_norm > 0,
                 packed=cfg.data.packing and t.objective == "sft", method=t.method,
                 regen=None if t.clip_regen == "auto" else t.clip_regen,
                 rollout=rollout_rows(cfg) if t.objective == "grpo" else 0,
                 rollout_tokens=rollout_tokens(cfg), rollout_group=cfg.grpo.group_size,
                 rollout_new_tokens=min(cfg.grpo.max_new_tokens, cfg.data.max_seq_len),
                 lora=None if t.method == "full" else for_model(lora_spec(cfg.lora), spec))


def rollout_rows(cfg: RunConfig) -> int:
    """GRPO's rows decoded together: grpo.prompts_together prompts' groups (at most a step's)."""
    g, t = cfg.grpo, cfg.train
    return g.group_size * min(g.prompts_together, max(1, t.micro_batch * t.grad_accum // g.group_size))


def rollout_tokens(cfg: RunConfig) -> int:
    """KV-cache positions a rollout row holds: its prompt and reply (data.max_seq_len at most)
    alone; decoded beside other prompts (grpo.sample_groups) the longest prompt's slots and
    then the longest reply's, up to max_seq_len + min(max_new_tokens, max_seq_len)."""
    seq = cfg.data.max_seq_len
    return seq if rollout_rows(cfg) <= cfg.grpo.group_size else \
        seq + min(cfg.grpo.max_new_tokens, seq)


@dataclass(frozen=True)
class Machine:
    """What every plan of one run config on one machine shares, resolved once (the budgets
    ``auto`` read NVML and psutil when it is made)."""
    hardware: HardwareProfile
    device: str
    """cuda or cpu: the backend the run uses."""
    budgets: Budgets


def resolve_machine(cfg: RunConfig, hardware: HardwareProfile | str = "auto",
                    device: str | None = None) -> Machine:
    """The machine :func:`plan_run` plans ``cfg`` on (its arguments say how)."""
    hw = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    if hardware == "auto" and cpu_adam.unavailable_reason():  # a plan of this machine
        hw = hw.without_native_adam(cpu_adam.unavailable_reason())
    device = device or run_device(cfg, hw)
    if device == "cuda" and hw.matmul_tflops <= 0:
        raise UserError("train.device", f"is cuda but {hw.name} has no GPU to plan for",
                        "plan for a GPU (slideformer plan --gpu rtx4090, or the Plan page's "
                        "target), or use the CPU backend")
    gpu = None if hw.preset else gpu_memory()  # a preset's VRAM is the preset's, not this GPU's
    return Machine(hw, device, resolve_budgets(cfg.budget, device, hw, gpu, host_memory()))


def plan_run(cfg: RunConfig, spec: ModelSpec, device: str | None = None,
             hardware: HardwareProfile | str = "auto", speculate: bool = True) -> Plan:
    """The plan of a run config on a machine (budgets ``auto`` read NVML and psutil here).

    Args:
        device: the backend the run uses; None derives it from ``train.device`` and the profile.
        hardware: a profile, or the target to plan for (slideformer.engine.plan.targets.load_profile: this
            machine, a GPU preset such as ``rtx4090``, or a profile file).
        speculate: False for one rank of a data-parallel run (no speculative layers).
    """
    validate(cfg, "values")
    m = resolve_machine(cfg, hardware, device)
    knobs = replace(knobs_from_config(cfg, spec, m.device), speculate=speculate)
    return make_plan(spec, knobs, m.device, m.budgets, m.hardware)


def fit_verdict(cfg: RunConfig, spec: ModelSpec, machine: Machine) -> tuple[str, str]:
    """The verdict and reason :func:`plan_run` gives ``cfg`` on ``machine``, without the rest of
    the plan (fixes, largest batches, speed): 3-10% of its time (a tiny Llama to an 8B, each
    method, measured)."""
    knobs = knobs_from_config(cfg, spec, machine.device)
    base = Evaluator(spec, machine.device, machine.budgets, machine.hardware).choose(knobs)
    return _verdict(base.tiers, machine.hardware)
