"""What the Plan page's bar charts show, read off an engine :class:`~slideformer.engine.plan.Plan`.

Two kinds of rows, both plain data (tested without any widget):
- :func:`memory_rows`: one stacked bar per tier (GPU, host RAM, NVMe disk) made of the
  allocations held at that tier's peak, coloured by what they are, with the budget as the limit;
- :func:`busy_rows`: seconds of work per step on each resource, the step time as the limit.
Every number is the planner's; this module only chooses words and colours.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

from PySide6.QtGui import QColor

from slideformer.engine.api import Allocation, Plan, TierUse
from slideformer.gui.models.formatting import human_bytes, resource_title


@dataclass(frozen=True)
class Segment:
    """One piece of a bar."""
    key: str
    """The allocation's purpose, or the resource's name."""
    value: float
    """Bytes, or seconds."""
    color: str
    label: str
    """Drawn inside the segment when it is wide enough."""
    short: str
    """Drawn instead when only this fits."""
    tooltip: str


@dataclass(frozen=True)
class Row:
    """One bar: its title, segments and the line it must stay under."""
    key: str
    """gpu, host, disk, or a resource name."""
    title: str
    subtitle: str
    segments: tuple[Segment, ...]
    limit: float | None
    """Where the line is drawn (the budget, or the step time); None: no line."""
    limit_label: str
    right: str
    """Text right of the bar (the share of the budget)."""
    state: str
    """Colour of that text: ok, tight, over, bound or plain."""
    empty: str = ""
    """Written in the track when there is nothing to draw."""


# ---- memory ---------------------------------------------------------------------------------
# Colour groups of the legend, in the order segments are stacked: (name, colour, what it holds).
CATEGORIES = (
    ("Weights", "#3b82f6", "the model's weights: host copy, GPU slots, resident embedding and head"),
    ("Optimizer state", "#8b5cf6", "AdamW moments m and v, and the update's scratch"),
    ("Gradients", "#f59e0b", "fp32 gradient buffers and slots, layer grads before they are added"),
    ("Activations", "#10b981", "checkpoints between layers, hidden states, inputs and masks"),
    ("Step scratch", "#ec4899", "temporaries of one layer's forward, the LM head and a backward"),
    ("Loading", "#06b6d4", "buffers used only while the weights are read from disk"),
    ("Runtime", "#94a3b8", "Python and torch, the CUDA context, libraries, the allocator's reserve"),
)
_PURPOSES = {
    "Weights": ("bfloat16 weights", "float32 weights", "weight remainders", "parameter slots",
                "embedding weights", "head weights", "device layers", "frozen base weights",
                "base staging buffers", "frozen base on NVMe"),
    "Optimizer state": ("AdamW moments m, v", "optimizer scratch", "NVMe staging buffers",
                        "NVMe tier", "embedding and head optimizer state",
                        "device optimizer scratch"),
    "Gradients": ("gradient buffers", "embedding grads", "head grads", "gradient slots",
                  "layer grads in compute dtype"),
    "Activations": ("activation checkpoints", "pinned activation checkpoints", "checkpoint staging",
                    "hidden states and their grads", "inputs and RoPE tables", "attention masks"),
    "Step scratch": ("layer forward scratch", "LM-head chunk and loss", "recompute activations",
                     "FP8 operand copies", "FP8 operand copies (backward)"),
    "Loading": ("load buffer",),
    "Runtime": ("runtime baseline", "runtime working memory", "CUDA context", "cuBLAS workspaces",
                "allocator reserve"),
}
_CATEGORY_OF = {p: name for name, purposes in _PURPOSES.items() for p in purposes}
_COLOR = {name: color for name, color, _ in CATEGORIES}
OTHER = "Runtime"
"""The group of a purpose this page does not know yet (drawn, never dropped)."""

TIER_TITLES = {"gpu": "GPU memory", "host": "Host RAM", "disk": "NVMe disk"}
PEAK_WHEN = {"setup": "loading weights", "dequant": "NF4 dequantisation", "forward": "forward", "head": "LM head",
             "backward": "backward", "run": "training", "rollout": "sampling replies (GRPO)"}
HELD = {"state": "held for the whole run", "run": "held while training",
        "step": "held during each step", "setup": "only while the weights load",
        "dequant": "only while an NF4 layer is dequantised",
        "forward": "only during a layer's forward", "head": "only during the LM head",
        "backward": "only during a layer's backward",
        "rollout": "only while GRPO samples the step's replies"}


def category(purpose: str) -> str:
    return _CATEGORY_OF.get(purpose, OTHER)


def allocation_tiers(plan: Plan, tier: str) -> tuple[str, ...]:
    """Allocation tiers counted in ``tier``: on the CPU backend the "gpu" buffers are host RAM
    (as slideformer.engine.plan.evaluate counts them)."""
    if tier == "host" and plan.device != "cuda":
        return ("gpu", "host")
    return (tier,)


def held_at_peak(plan: Plan, use: TierUse) -> list[Allocation]:
    """The allocations held when ``use.tier`` peaks, which add up to ``use.peak``.

    The phase rule of slideformer.engine.plan.memory.peak: at a "setup" peak the state and the loading
    buffers; otherwise the state, the run's buffers, the step's and the peak part's transients.
    """
    phases = ({"state", "setup"} if use.phase == "setup" else {"state", "run", "rollout"}
              if use.phase == "rollout" else {"state", "run", "step", use.phase})
    tiers = allocation_tiers(plan, use.tier)
    return [a for a in plan.allocations
            if a.tier in tiers and a.phase in phases and a.bytes > 0]


def _share_state(use: TierUse) -> str:
    if not use.budget:
        return "plain"
    return "over" if use.peak > use.budget else "tight" if use.peak > 0.9 * use.budget else "ok"


def _segments(allocs: list[Allocation]) -> tuple[Segment, ...]:
    order = {name: i for i, (name, _, _) in enumerate(CATEGORIES)}
    allocs = sorted(allocs, key=lambda a: order[category(a.purpose)])  # stable: engine order inside
    out, shade = [], {}
    for a in allocs:
        cat = category(a.purpose)
        n = shade[cat] = shade.get(cat, -1) + 1
        base = QColor(_COLOR[cat])  # neighbours of one group stay apart
        color = (base, base.lighter(122), base.darker(122))[n % 3].name()
        tip = (f"<b>{html.escape(a.purpose)}</b><br>{human_bytes(a.bytes)} &middot; "
               f"{cat.lower()}<br>{html.escape(a.detail)}<br><i>{HELD[a.phase]}</i>")
        out.append(Segment(a.purpose, a.bytes, color, f"{a.purpose} {human_bytes(a.bytes)}",
                           human_bytes(a.bytes), tip))
    return tuple(out)


def memory_rows(plan: Plan) -> tuple[Row, ...]:
    """One row per tier: what is held at its peak, against its budget."""
    rows = []
    for use in plan.tiers:
        segs = _segments(held_at_peak(plan, use))
        empty = ""
        if use.tier == "gpu" and plan.device != "cuda":
            segs, empty = (), "CPU backend: the device buffers are counted in host RAM"
        elif use.tier == "disk" and not use.peak:
            empty = ("no NVMe folder chosen" if not use.budget else
                     f"{human_bytes(use.budget)} available; host RAM needs none of it")
        if use.budget and not empty:
            sub = f"{human_bytes(use.peak)} of {human_bytes(use.budget)}"
        else:
            sub = human_bytes(use.peak) if not empty else ""
        if use.budget and not empty:
            sub += f"\npeak: {PEAK_WHEN.get(use.phase, use.phase)}"
        rows.append(Row(use.tier, TIER_TITLES[use.tier], sub, segs,
                        use.budget if use.budget and not empty else None,
                        f"budget {human_bytes(use.budget)}" if use.budget else "",
                        f"{use.share:.0%}" if use.share is not None and not empty else "",
                        _share_state(use), empty))
    return tuple(rows)


# ---- speed ----------------------------------------------------------------------------------
RESOURCE_HELP = {
    "gpu compute": "forward, recompute and backward of every layer, and the LM head",
    "pcie h2d": "layer weights (and host checkpoints) copied to the GPU",
    "pcie d2h": "fp32 gradients (and checkpoints) copied back to host RAM",
    "cpu optimizer": "AdamW on the CPU over every parameter, once per step",
    "disk": "optimizer state read and written, or a frozen base read, on the NVMe tier",
}
BOUND_COLOR, BUSY_COLOR = "#f97316", "#64748b"


def busy_rows(plan: Plan) -> tuple[Row, ...]:
    """Seconds of work per step on each resource; the busiest one is what bounds the step."""
    sp = plan.speed
    rows = []
    for name, seconds in sp.busy:
        title = resource_title(name, plan.device)
        bound = name == sp.bound
        share = f"{seconds / sp.step_time:.0%} of the step" if sp.step_time else ""
        tip = (f"<b>{title}</b>{' (the bound)' if bound else ''}<br>{seconds:.2f} s of work per "
               f"step, {share}<br>{RESOURCE_HELP.get(name, '')}")
        seg = Segment(name, seconds, BOUND_COLOR if bound else BUSY_COLOR, f"{seconds:.2f} s", "", tip)
        rows.append(Row(name, title, "", (seg,) if seconds > 0 else (), sp.step_time,
                        f"step {sp.step_time:.2f} s", f"{seconds:.2f} s",
                        "bound" if bound else "plain", "" if seconds > 0 else "idle"))
    return tuple(rows)
