"""Memory & speed planner and hardware calibration (DESIGN §4).

``plan_run(cfg, spec)`` / ``make_plan(...)`` -> :class:`Plan`: every allocation by tier, purpose
and phase, predicted peaks, verdict and fixes, the largest batches, predicted speed, and the
executor shape the Trainer runs with. ``slideformer plan`` and ``slideformer bench --hardware``
are in slideformer.engine.plan.commands.
"""
import importlib

# Imported on first use (PEP 562): the CLI registers ``plan`` and ``bench`` from
# slideformer.engine.plan.commands without importing torch, which the planner needs.
_SOURCES = {"Budgets": "budget", "resolve_budgets": "budget", "Knobs": "evaluate",
            "TierUse": "evaluate", "Fix": "fixes", "REFERENCE": "hardware",
            "HardwareProfile": "hardware", "PRESETS": "targets", "load_profile": "targets", "Allocation": "memory",
            "Precision": "memory", "allocations": "memory", "Plan": "planner",
            "knobs_from_config": "planner", "make_plan": "planner", "plan_run": "planner",
            "SpeedEstimate": "speed"}

__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_SOURCES[name]}"), name)
