"""Remedies for a run that does not fit (or barely does): what each saves, and whether it suffices.

Each fix changes one setting and is evaluated by the same memory model as the plan itself:
smaller micro-batch; the same global batch through more accumulation; checkpoints to host;
fewer parameter slots; regenerated gradients (with exact clipping and ``train.clip_regen`` set:
the fewest lowest layers whose gradient a second backward pass regenerates); bf16 moments (or
8-bit ones where bf16 does not suffice) or a bf16 residual stream (change the numerics: opt-in);
optimizer state on disk (the NVMe tier: the moments of the fewest layers that make host RAM
fit), or with a frozen base the base of the fewest layers; another method (LoRA or QLoRA adapters over a frozen base). They come cheapest first: those that make the run fit, exact
ones before numerics-changing ones, the chosen method before another, faster ones first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from slideformer.engine.config import format_bytes
from slideformer.engine.plan.evaluate import Evaluation, Evaluator, Knobs
from slideformer.engine.runtime.shapes import QBLOCK

_NO_LIMIT = 1 << 62
"""A disk budget that holds anything (what the NVMe-tier fix would need)."""


@dataclass(frozen=True)
class Fix:
    """One change that lowers memory, with what it saves and costs."""
    name: str
    change: str
    """The change in words, e.g. "micro_batch 8 -> 5, grad_accum 1 -> 2"."""
    settings: tuple[tuple[str, object], ...]
    """Config keys to set (slideformer.engine.config.override accepts them)."""
    tier: str
    """The tier whose peak it lowers the most."""
    saves: int
    """Bytes it takes off that tier's peak."""
    fits: bool
    """With this change every budget holds (and the relieved tiers drop below 90% of theirs
    when the plan was only tight)."""
    available: bool = True
    """False: the engine cannot do this yet."""
    exact: bool = True
    """False: it changes the numerics (a named, opt-in trade-off)."""
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class _Goal:
    """The tiers a fix must relieve, and the share of their budgets that counts as relieved."""
    tiers: tuple[str, ...]
    share: float

    def met(self, e: Evaluation) -> bool:
        limit = {t: self.share if t in self.tiers else 1.0 for t in ("gpu", "host", "disk")}
        return all(u.budget is None or u.peak <= limit[u.tier] * u.budget for u in e.tiers)


def _fix(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal, name: str, change: str,
         settings: dict, **kw) -> Fix | None:
    e = ev.choose(k)
    saved = {t.tier: b.peak - t.peak for t, b in zip(e.tiers, base.tiers) if t.tier in goal.tiers}
    tier = max(saved, key=saved.get)
    if saved[tier] <= 0:
        return None
    ok = goal.met(e)
    return Fix(name, change, tuple(settings.items()), tier, saved[tier], ok,
               tokens_per_s=ev.speed(k, e).tokens_per_s if ok else None, **kw)


def _smaller_micro_batch(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    if k.micro_batch <= 1:
        return []
    m = ev.largest(lambda b: b < k.micro_batch and goal.met(ev.choose(replace(k, micro_batch=b)))) or 1
    out = [_fix(ev, base, replace(k, micro_batch=m), goal, "smaller micro-batch",
                f"micro_batch {k.micro_batch} -> {m} (global batch {k.micro_batch * k.grad_accum} "
                f"-> {m * k.grad_accum} sequences)", {"train.micro_batch": m})]
    # The same global batch in more, smaller micro-batches: the checkpoints stay (they hold
    # every micro-batch), the per-micro-batch scratch shrinks.
    for b in range(k.micro_batch - 1, 0, -1):
        n = math.ceil(k.micro_batch * k.grad_accum / b)
        kk = replace(k, micro_batch=b, grad_accum=n)
        if goal.met(ev.choose(kk)) or b == 1:
            out.append(_fix(ev, base, kk, goal, "more accumulation instead",
                            f"micro_batch {k.micro_batch} -> {b}, grad_accum {k.grad_accum} -> {n} "
                            f"(global batch {b * n} sequences)",
                            {"train.micro_batch": b, "train.grad_accum": n}))
            break
    return out


def _checkpoints_to_host(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    if base.shape.checkpoints == "host":
        return []
    return [_fix(ev, base, replace(k, checkpoints="host"), goal, "checkpoints to host",
                 "activation checkpoints in pinned host memory, prefetched a layer ahead",
                 {"budget.checkpoints": "host"})]


def _fewer_slots(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    least = min(2, ev.spec.num_layers)
    if base.shape.slots <= least:
        return []
    return [_fix(ev, base, replace(k, slots=least), goal, "fewer slots",
                 f"parameter slots {base.shape.slots} -> {least}", {"budget.slots": least})]


def _regenerate_gradients(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    """With exact clipping and a number of regenerated layers set by the config
    (train.clip_regen): the planner's own choice, the fewest that make host RAM fit
    (slideformer.engine.plan.evaluate), when that is more; each costs its layer's backward again."""
    if k.method != "full" or not k.clip or k.regen is None or "host" not in goal.tiers:
        return []
    n = ev.choose(replace(k, regen=None)).shape.regen_layers
    if n <= k.regen:
        return []
    kk = replace(k, regen=n)
    before = ev.speed(k, base).tokens_per_s
    after = ev.speed(kk, ev.choose(kk)).tokens_per_s
    return [_fix(ev, base, kk, goal, "regenerate gradients",
                 f"train.clip_regen {k.regen} -> {n} (a second backward regenerates the gradients "
                 f"of the lowest {n} layers: exact clipping in less RAM, "
                 f"{1 - after / before:.0%} fewer tokens/s)", {"train.clip_regen": n})]


_SMALLER_MOMENTS = ((torch.bfloat16, "bf16 moments", "bfloat16",
                     "AdamW m and v in bfloat16 (slightly different numerics)"),
                    (torch.int8, "int8 moments", "int8",
                     "AdamW m and v in 8-bit blocks with a scale each, a quarter of fp32 "
                     "(slightly different numerics)"))


def _smaller_moments(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    """bf16 moments; 8-bit ones only where bf16 ones do not make the run fit (the larger change
    of the numerics)."""
    if k.method != "full":
        return []
    fixes = []
    for dtype, name, value, change in _SMALLER_MOMENTS:
        if k.precision.moment_bytes(QBLOCK) <= replace(k.precision, moments=dtype).moment_bytes(QBLOCK):
            continue  # not smaller than the moments already chosen
        kk = replace(k, precision=replace(k.precision, moments=dtype))
        fix = _fix(ev, base, kk, goal, name, change, {"optim.moments_dtype": value}, exact=False)
        if fix is not None:
            fixes.append(fix)
            if fix.fits:
                break
    return fixes


def _bf16_residual(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    """train.precision bf16: half the activation checkpoints and hidden states."""
    if not k.precision.wide:
        return []
    kk = replace(k, precision=replace(k.precision, residual=None))
    return [_fix(ev, base, kk, goal, "bf16 residual stream",
                 "train.precision autocast -> bf16 (checkpoints in bf16; further from fp32)",
                 {"train.precision": "bf16"}, exact=False)]


def _states_to_disk(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    """The NVMe tier with room for what host RAM needs moved (the planner then moves exactly
    that: the fewest layers that fit, see slideformer.engine.plan.evaluate): the AdamW moments of full
    training, or the frozen base of lora / qlora. Only for a host over its budget: a tight one
    stays in RAM (disk layers cost reads, and with moments writes, every step). The plan with
    the tier then keeps host RAM within the budget less evaluate.DISK_MARGIN."""
    if "host" not in goal.tiers or goal.share < 1.0 or base.disk_layers == ev.spec.num_layers:
        return []
    roomy = Evaluator(ev.spec, ev.device, replace(ev.budgets, disk=_NO_LIMIT), ev.hw)
    e = roomy.choose(k)
    need = e.tiers[2].peak
    if not e.disk_layers or need <= ev.budgets.disk:
        return []
    size = f"{math.ceil(need / 2**30)}GiB"
    name, what = (("optimizer state on disk", "AdamW moments") if k.method == "full" else
                  ("move the base to NVMe", "frozen base weights"))
    fix = _fix(roomy, base, k, goal, name,
               f"{what} of {e.disk_layers} of {ev.spec.num_layers} layers on the NVMe tier "
               f"({size} of disk)", {"budget.nvme_dir": ev.budgets.disk_path or "<folder on an NVMe disk>",
                                     "budget.nvme_size": size})
    return [fix] if fix is not None else []


def _frozen_base(ev: Evaluator, base: Evaluation, k: Knobs, goal: _Goal) -> list:
    """Train adapters over a frozen base instead (LoRA), or over a 4-bit base (QLoRA): a
    different method, so never counted as exact."""
    from slideformer.engine.config import LoraConfig
    from slideformer.engine.models.lora import for_model, lora_spec
    lora = k.lora or for_model(lora_spec(LoraConfig()), ev.spec)
    methods = {"full": ("lora", "qlora"), "lora": ("qlora",)}.get(k.method, ())
    words = {"lora": "LoRA adapters over the frozen bf16 base",
             "qlora": "QLoRA: LoRA adapters over the base quantised to 4-bit NF4"}
    return [_fix(ev, base, replace(k, method=m, lora=lora), goal, f"switch to {m}",
                 f"train.method {k.method} -> {m} ({words[m]})", {"train.method": m}, exact=False)
            for m in methods]


def find_fixes(ev: Evaluator, base: Evaluation, k: Knobs, tiers: tuple[str, ...],
               share: float) -> tuple[Fix, ...]:
    """Every fix that relieves ``tiers`` (peaks above ``share`` of their budgets), cheapest first."""
    goal = _Goal(tiers, share)
    fixes = []
    for make in (_smaller_micro_batch, _checkpoints_to_host, _fewer_slots, _regenerate_gradients,
                 _smaller_moments,
                 _bf16_residual, _states_to_disk, _frozen_base):
        fixes += [f for f in make(ev, base, k, goal) if f is not None]
    # another training method comes after every change within the chosen one
    return tuple(sorted(fixes, key=lambda f: (not f.fits, not f.available, not f.exact,
                                              "train.method" in dict(f.settings),
                                              -(f.tokens_per_s or 0.0), -f.saves)))


_RESIDENT = "resident embedding and head with fp32 grads"
_RESIDENT_PARTS = ("embedding weights", "head weights", "embedding grads", "head grads")


def floor_notes(ev: Evaluator, k: Knobs, tiers: tuple[str, ...]) -> tuple[str, ...]:
    """When no setting can make a tier fit: the least it needs with every fix combined."""
    frozen = k.method != "full"
    least = replace(k, micro_batch=1, grad_accum=1, checkpoints="host", slots=min(2, ev.spec.num_layers), gpu_layers=0,
                    precision=replace(k.precision, moments=torch.int8),
                    disk_layers=ev.spec.num_layers if frozen else k.disk_layers)
    e = ev.choose(least)
    notes = []
    for t in e.tiers:
        need = t.peak
        if t.tier == "host":  # the moments could move to disk too
            need -= sum(a.bytes for a in e.allocs if a.purpose == "AdamW moments m, v")
        if t.tier in tiers and t.budget is not None and need > t.budget:
            groups: dict[str, int] = {}
            for a in e.allocs:
                if a.tier == t.tier and a.purpose != "AdamW moments m, v":
                    name = _RESIDENT if a.purpose in _RESIDENT_PARTS else a.purpose
                    groups[name] = groups.get(name, 0) + a.bytes
            big = ", ".join(f"{n} {format_bytes(b)}" for n, b in
                            sorted(groups.items(), key=lambda nb: -nb[1])[:3])
            fixes = ("2 slots and the base's layers on disk" if frozen else
                     "2 slots, int8 moments and the moments on disk")
            notes.append(f"no setting makes {t.tier} fit: with micro-batch 1, host checkpoints, "
                         f"{fixes} it still needs {format_bytes(need)} of "
                         f"{format_bytes(t.budget)} ({big})")
    return tuple(notes)
