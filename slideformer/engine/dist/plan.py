"""The plan of a run on N GPUs of one host (``slideformer plan --gpus N``).

Each rank is a one-GPU run over 1/N of the step's micro-batches with every update on the host
(slideformer.engine.dist.ranks.rank_shape), so one rank's plan is the per-GPU plan: its VRAM
tier is what each GPU holds. The host holds the model state once (shared memory) and each
rank's own buffers N times. Per step, each GPU:

    computes   1/N of the micro-batches (the per-rank plan's compute time)
    loads      every layer over its own PCIe link (the same traffic as one GPU)
    reduces    every gradient: a ring all-reduce moves 2 (N-1)/N x 4 B per parameter per GPU,
               at the PCIe rate (no NVLink assumed), on the compute stream (not overlapped)
    updates    1/N of every item on the host; the N processes share the CPU's cores, so the
               CPU optimizer time is that of one GPU's run (no faster, no slower)

The step time is the per-rank plan's plus the all-reduce: a prediction for GPUs on separate
PCIe links; GPUs behind one switch share its bandwidth (not modelled).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slideformer.engine import config as config_mod
from slideformer.engine.config import RunConfig, format_bytes
from slideformer.engine.models.spec import ModelSpec

SHARED = ("weight remainders", "AdamW moments m, v", "gradient buffers", "load buffer")
"""Host allocations held once for all ranks (besides the weights): the shared state and rank
0's load buffer (it alone reads the model)."""


@dataclass(frozen=True)
class GpusPlan:
    """A run on ``gpus`` GPUs of one host."""
    gpus: int
    per_gpu: object
    """The plan of one rank (slideformer.engine.plan.planner.Plan): its VRAM is per GPU."""
    host_shared: int
    """Host bytes held once: the model state in shared memory (and rank 0's load buffer)."""
    host_per_rank: int
    """Host bytes each rank holds on its own (runtime, scratch, pinned checkpoints)."""
    allreduce_s: float
    """Seconds per step of each GPU's gradient all-reduce."""
    step_time: float
    tokens_per_s: float

    @property
    def host_peak(self) -> int:
        return self.host_shared + self.gpus * self.host_per_rank

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["per_gpu"] = self.per_gpu.to_dict()
        d["host_peak"] = self.host_peak
        return d


def rank_config(cfg: RunConfig, gpus: int) -> RunConfig:
    """The config one rank runs: 1/N of the micro-batches, every update on the host."""
    return config_mod.override(cfg, {"train.grad_accum": cfg.train.grad_accum // gpus,
                                     "train.gpus": 1, "budget.gpu_layers": 0})


def plan_gpus(cfg: RunConfig, spec: ModelSpec, gpus: int, hardware="auto") -> GpusPlan:
    """The plan of ``cfg`` on ``gpus`` GPUs (a config that slideformer.engine.validate accepts)."""
    from slideformer.engine.plan.planner import plan_run

    one = plan_run(rank_config(cfg, gpus), spec, hardware=hardware, speculate=gpus == 1)
    host = [a for a in one.allocations if a.tier == "host"]
    shared = sum(a.bytes for a in host if _shared(a.purpose))
    own = sum(a.bytes for a in host if not _shared(a.purpose))
    link = min(one.hardware.h2d_gbs, one.hardware.d2h_gbs) * 1e9
    reduce_s = 2 * (gpus - 1) / gpus * 4 * spec.num_params / link if gpus > 1 and link else 0.0
    step = one.speed.step_time + reduce_s
    return GpusPlan(gpus, one, shared, own, reduce_s, step,
                    gpus * one.tokens_per_step / step if step else 0.0)


def _shared(purpose: str) -> bool:
    return purpose in SHARED or purpose.endswith(" weights")


def format_gpus(p: GpusPlan) -> str:
    """The lines ``slideformer plan --gpus N`` adds under the per-GPU plan."""
    budget = p.per_gpu.tier("host").budget
    room = "" if budget is None else f" of {format_bytes(budget)}" + (
        " (does not fit)" if p.host_peak > budget else "")
    return "\n".join([
        f"On {p.gpus} GPUs (data parallel; the plan above is each GPU's):",
        f"  host RAM   {format_bytes(p.host_peak)}{room}: the model state once "
        f"({format_bytes(p.host_shared)}, shared memory) + {p.gpus} x "
        f"{format_bytes(p.host_per_rank)} per rank",
        f"  all-reduce {p.allreduce_s * 1e3:.1f} ms per step per GPU (gradients, fp32, at the "
        f"PCIe rate)",
        f"  speed      {p.tokens_per_s:,.0f} tokens/s ({p.step_time:.2f} s per step of "
        f"{p.gpus * p.per_gpu.tokens_per_step:,} tokens)"])
