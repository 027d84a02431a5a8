"""What fits: the machines a plan can be made for, and the planner's verdict for each training
method (full fine-tuning, LoRA, QLoRA) on one of them.

Plain data and plain functions, tested without any widget. :func:`method_fits` waits for the
planner (three plans): call it off the GUI thread.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slideformer.engine.api import PRESETS, HardwareProfile, Plan, UserError, load_profile
from slideformer.gui.workers.thread import TaskError

THIS_MACHINE = "this"
METHODS = (("full", "Full fine-tuning"), ("lora", "LoRA"), ("qlora", "QLoRA"))
"""train.method values, in the order they are shown, with their names for people."""
METHOD_TITLES = dict(METHODS)
VERDICT_TITLES = {"fits": "Fits", "tight": "Tight", "does not fit": "Does not fit"}
VERDICT_STATES = {"fits": "ok", "tight": "tight", "does not fit": "over"}
"""Verdict -> the colour its text takes (see widgets.bars.STATE_COLORS)."""


def targets() -> list[tuple[str, str]]:
    """(name for people, target key) of every machine a plan can be made for: this one first,
    then the GPU presets."""
    return [("This machine", THIS_MACHINE)] + [
        (p.name.removeprefix("NVIDIA "), key) for key, p in PRESETS.items()]


@dataclass(frozen=True)
class MethodFit:
    """The planner's answer for one training method."""
    method: str
    """train.method: full, lora or qlora."""
    verdict: str
    """fits, tight or does not fit."""
    reason: str
    """The planner's reason, as it words it ("fits with 18.5 GiB of host RAM to spare on ...")."""
    tokens_per_s: float
    """The predicted speed (of these settings if they fitted)."""
    ram_budget: int = 0
    """The host RAM the verdict assumed, in bytes (with ``budget.ram = auto``: what the planner
    found available when it ran)."""

    @property
    def title(self) -> str:
        return METHOD_TITLES[self.method]


Planner = Callable[[str, dict, HardwareProfile], Plan]
"""``plan(model_path, settings, hardware) -> Plan`` (e.g. the app's planner process's)."""


def method_fits(plan: Planner, model_path: str, settings: dict,
                hardware: HardwareProfile | str) -> tuple[MethodFit, ...]:
    """The verdict of ``settings`` (run-config keys) under each method, on ``hardware`` (a
    profile, or a target key: this machine or a preset)."""
    if isinstance(hardware, str):
        hardware = load_profile(hardware)
    fits = []
    for method, _ in METHODS:
        p = plan(model_path, {**settings, "train.method": method}, hardware)
        fits.append(MethodFit(method, p.verdict, p.reason, p.speed.tokens_per_s, p.budgets.ram))
    return tuple(fits)


def numbered_fits(version: int, plan: Planner, model_path: str, settings: dict,
                  hardware: HardwareProfile | str) -> tuple[int, tuple[MethodFit, ...], str]:
    """``(version, fits, "")``, or ``(version, (), message for people)``: the answer of
    :func:`method_fits` for a page's request number ``version``, as one signal argument (the
    page's own method receives it, and is disconnected when the page goes)."""
    try:
        return version, method_fits(plan, model_path, settings, hardware), ""
    except (UserError, TaskError) as e:
        return version, (), str(e)


def fits_html(fits: tuple[MethodFit, ...], colors: dict[str, str]) -> str:
    """One line: each method's name and verdict, the verdict in its colour."""
    return " &nbsp;&middot;&nbsp; ".join(
        f'{f.title}: <b style="color:{colors[VERDICT_STATES[f.verdict]]}">'
        f'{VERDICT_TITLES[f.verdict].lower()}</b>' for f in fits)
