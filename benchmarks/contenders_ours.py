"""Our engine's contenders, resident and sliding, as the planner shapes them
(benchmarks/contenders.py)."""
from __future__ import annotations

import dataclasses
import math
import time
from types import SimpleNamespace

import torch

from contenders_common import (CAPPED, GiB, BenchConfig, cap_vram, emit, environment, guarded)
from sliding_step import make_backend, plan_shape, random_state, run_config, shape_spec

from slideformer.engine.runtime.shapes import borrowed_layers, device_items

OUR_LANES = {"compute": "GPU compute", "h2d": "PCIe H2D", "d2h": "PCIe D2H",
             "optimizer": "CPU optimizer"}


def our_args(cfg: BenchConfig, micro_batch: int, slots: int, checkpoints: str = "gpu",
             head_chunk: int | None = None, warmup: int | None = None, steps: int | None = None):
    """sliding_step.run_config's arguments."""
    return SimpleNamespace(shape=cfg.shape, micro_batch=micro_batch, seq=cfg.seq, slots=slots,
                           checkpoints=checkpoints, head_chunk=head_chunk or cfg.head_chunk,
                           clip=cfg.clip, vram_cap=cfg.vram_cap,
                           warmup=cfg.warmup if warmup is None else warmup,
                           steps=cfg.steps if steps is None else steps, precision="bf16",
                           objective="sft", moments="float32")


def our_row(cfg: BenchConfig, res: dict) -> dict:
    """run_config's figures plus the bounding resource: the busiest lane of a late step
    (run_config reads the timeline of the last step but one)."""
    busy = res["busy_last_step_s"]
    lane = max(busy, key=busy.get)
    name = "CPU compute" if lane == "compute" and cfg.device == "cpu" else OUR_LANES[lane]
    return dict(res, bounding=f"{name} (busy {busy[lane]:.2f} s of a step; median step "
                              f"{res['step_time_s']:.2f} s)")


def run_ours(cfg: BenchConfig, contender: str) -> None:
    backend = make_backend(cfg.device)
    if contender in CAPPED:
        cap_vram(cfg)
    t0 = time.perf_counter()
    spec = shape_spec(cfg.shape)
    borrowed, on_device = planned_state(cfg, spec, contender)
    host = random_state(spec, backend, torch.float32, layer_grads=cfg.clip > 0,
                        borrowed=borrowed, on_device=on_device)
    emit("info", **environment(cfg), params=spec.num_params,
         setup_s=round(time.perf_counter() - t0, 1))
    for accum in cfg.grad_accum:
        guarded("result", cfg, accum, lambda: our_planned(cfg, spec, host, backend, contender, accum))
    if cfg.max_batch and contender == "sliding":
        our_max_batch(cfg, spec, host, backend)
    backend.release_host()


def planned_state(cfg: BenchConfig, spec, contender: str) -> tuple[list[int], list[str]]:
    """With one size (side_by_side.run_per_size): the layers without a host gradient buffer
    and the device-updated items of the planner's shape, so the host state is the one
    ``slideformer train`` builds for it; several sizes share one state that owns every buffer."""
    if not (contender == "sliding" and cfg.device == "cuda" and len(cfg.grad_accum) == 1
            and not cfg.slots):
        return [], []
    s = plan_shape(spec, cfg.micro_batch, cfg.seq, cfg.grad_accum[0], cfg.clip, cfg.vram_cap).exec_shape
    L = spec.num_layers
    return borrowed_layers(s, L) if cfg.clip > 0 else [], device_items(s, L)


def our_planned(cfg: BenchConfig, spec, host, backend, contender: str, accum: int) -> dict:
    """One size with the executor shape ``slideformer train`` would run: the planner's, for the
    cap (sliding) or the whole GPU (resident: every layer, its master weights and moments on the
    GPU, i.e. dense training inside our engine). ``--slots`` > 0 fixes K for sliding instead,
    with checkpoints on the GPU and every update on the CPU."""
    vram = cfg.vram_cap if contender in CAPPED else 0
    if cfg.device != "cuda" or (contender == "sliding" and cfg.slots):
        slots = spec.num_layers if contender == "resident" else (cfg.slots or 2)
        return our_row(cfg, run_config(spec, host, backend, our_args(cfg, cfg.micro_batch, slots), accum))
    plan = plan_shape(spec, cfg.micro_batch, cfg.seq, accum, cfg.clip, vram)
    shape = plan.exec_shape
    row = run_config(spec, host, backend, our_args(cfg, cfg.micro_batch, shape.slots), accum, shape)
    return our_row(cfg, dict(row, planner_verdict=plan.verdict,
                             predicted_tokens_per_s=round(plan.speed.tokens_per_s),
                             predicted_vram_gib=round(plan.tier("gpu").peak / GiB, 2)))


def planner_shape(cfg: BenchConfig, spec, micro_batch: int):
    """The planner's largest micro-batch at grad_accum 1 under the VRAM cap, and the executor
    shape it picks for ``micro_batch`` (slots and checkpoint placement are its choice)."""
    plan = plan_shape(spec, micro_batch, cfg.seq, 1, cfg.clip, cfg.vram_cap, cfg.device)
    return plan.max_micro_batch, plan.exec_shape, plan.verdict


def our_max_batch(cfg: BenchConfig, spec, host, backend) -> None:
    """Run at the planner's largest micro-batch (expected to fit) and 25% above it (expected
    to run out of memory), each with the planner's shape for that micro-batch."""
    m_max, _, _ = planner_shape(cfg, spec, cfg.micro_batch)
    if not m_max:
        emit("max_batch", micro_batch=0, grad_accum=1, planner_max=0,
             error="the planner finds no micro-batch that fits the cap")
        return
    for mb, expect, warmup, steps in ((m_max, "fits", cfg.warmup, cfg.steps),
                                      (max(m_max + 1, math.ceil(1.25 * m_max)), "oom", 1, 1)):
        _, shape, verdict = planner_shape(cfg, spec, mb)
        args = our_args(cfg, mb, shape.slots, shape.checkpoints, shape.head_chunk, warmup, steps)
        ran = guarded("max_batch", cfg, 1,
                      lambda: our_row(cfg, run_config(spec, host, backend, args, 1, shape)), micro_batch=mb, planner_max=m_max, planner_verdict=verdict, expected=expect,
                      planner_shape=dataclasses.asdict(shape))
        if not ran:  # the planner's own size failed: 25% more tells nothing new
            break
