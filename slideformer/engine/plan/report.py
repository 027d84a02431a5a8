"""A plan as readable text: the allocation table, peaks, verdict, fixes, batches and speed."""
from __future__ import annotations

from slideformer.engine.plan.planner import Plan

GiB = 1 << 30
_PHASE = {"state": "held", "setup": "loading", "run": "held", "step": "step",
          "forward": "forward", "head": "head", "backward": "backward"}


def _g(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def format_plan(plan: Plan) -> str:
    """The text ``slideformer plan`` prints."""
    s, L = plan.exec_shape, next(a for a in plan.allocations if a.purpose == "parameter slots")
    lines = [f"model: {plan.model_type}, {plan.total_params:,} parameters",
             f"run: {plan.device}, {plan.method}, {plan.compute_dtype} compute, "
             f"{plan.moments_dtype} moments, "
             f"micro-batch {s.micro_batch} x {s.seq_len} tokens x {s.n_micro} accumulated "
             f"= {plan.tokens_per_step:,} tokens/step",
             f"hardware: {plan.hardware.name}",
             f"executor: {s.slots} parameter slots ({L.detail}), checkpoints on "
             f"{'the GPU' if s.checkpoints == 'gpu' else 'the host'}, LM-head chunks of "
             f"{s.head_chunk} tokens"]
    if plan.speed.kernels:  # CUDA plans: what their memory and speed assume
        lines.append(f"GPU kernels: {plan.speed.kernels}")
    lines.append("")
    lines += _table(plan)
    lines += ["", "peaks:"]
    for t in plan.tiers:
        share = f" ({t.share:.0%}, peak in the {t.phase})" if t.share is not None else ""
        source = {"gpu": plan.budgets.vram_source, "host": plan.budgets.ram_source,
                  "disk": plan.budgets.disk_source}[t.tier]
        lines.append(f"  {t.tier:<5} {_g(t.peak):>8} GiB of {_g(t.budget):>8} GiB{share}; budget {source}")
    lines.append(f"  predicted peak RSS (mapped model files included): {_g(plan.peak_rss)} GiB")
    lines += ["", f"verdict: {plan.verdict.upper()}: {plan.reason}"]
    if plan.fixes:
        lines.append("fixes, cheapest first:")
        for i, f in enumerate(plan.fixes, 1):
            tags = [("fits" if f.fits else "not enough alone")]
            tags += [] if f.exact else ["changes numerics"]
            tags += [] if f.available else ["not available yet"]
            speed = f", {f.tokens_per_s:,.0f} tok/s" if f.tokens_per_s else ""
            lines.append(f"  {i}. {f.name}: {f.change}; saves {_g(f.saves)} GiB of {f.tier} "
                         f"({', '.join(tags)}{speed})")
    lines += [f"note: {n}" for n in plan.notes]
    lines += ["", f"largest micro-batch: {plan.max_micro_batch} (with grad_accum {s.n_micro}); "
                  f"largest global batch: {plan.max_global_batch} sequences"]
    sp = plan.speed
    busy = ", ".join(f"{r} {t:.2f} s" for r, t in sp.busy)
    lines += [f"speed: {sp.step_time:.2f} s/step, {sp.tokens_per_s:,.0f} tokens/s, bound by {sp.bound}",
              f"  work per step: {busy}"]
    return "\n".join(lines)


def _table(plan: Plan) -> list[str]:
    rows = [("tier", "purpose", "GiB", "when", "detail")]
    for a in plan.allocations:
        when = _PHASE[a.phase] + (", reclaimable" if a.reclaimable else "")
        rows.append((a.tier, a.purpose, _g(a.bytes), when, a.detail))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:<{w[3]}}  {r[4]}" for r in rows]
