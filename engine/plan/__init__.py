"""Memory & speed planner and hardware calibration (DESIGN §4).

``plan_run(cfg, spec)`` / ``make_plan(...)`` -> :class:`Plan`: every allocation by tier, purpose
and phase, predicted peaks, verdict and fixes, the largest batches, predicted speed, and the
executor shape the Trainer runs with. ``slideformer plan`` and ``slideformer bench --hardware``
are in engine.plan.commands.
"""
from engine.plan.budget import Budgets, resolve_budgets
from engine.plan.evaluate import Knobs, TierUse
from engine.plan.fixes import Fix
from engine.plan.hardware import REFERENCE, HardwareProfile
from engine.plan.memory import Allocation, Precision, allocations
from engine.plan.planner import Plan, knobs_from_config, make_plan, plan_run
from engine.plan.speed import SpeedEstimate
from engine.plan.targets import PRESETS, load_profile

__all__ = ["Allocation", "Budgets", "Fix", "HardwareProfile", "Knobs", "PRESETS", "Plan", "Precision",
           "REFERENCE", "SpeedEstimate", "TierUse", "allocations", "knobs_from_config",
           "load_profile", "make_plan", "plan_run", "resolve_budgets"]
