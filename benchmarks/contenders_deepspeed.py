"""The deepspeed contender: ZeRO-3 with parameters and optimizer offloaded to the CPU
(benchmarks/contenders.py)."""
from __future__ import annotations

import os
import time

import torch

from contenders_common import (LR, BenchConfig, cap_vram, emit, environment, guarded, hf_bounding,
                               hf_config, hf_params, reset_vram_peaks, summary, time_hf_steps,
                               token_ids)


def ds_config(cfg: BenchConfig, accum: int) -> dict:
    """ZeRO-3 with parameters and optimizer state on the CPU (DeepSpeed's defaults otherwise)."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": accum,
        "train_batch_size": cfg.micro_batch * accum,
        "gradient_clipping": cfg.clip,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(cfg: BenchConfig):
    """The engine on an HF model built under zero.Init (HF's own ZeRO-3 path: HfDeepSpeedConfig
    alive while ``from_config`` runs), so the full model never sits in VRAM."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    ds_cfg = ds_config(cfg, cfg.grad_accum[0])
    deepspeed.init_distributed(dist_backend="nccl" if cfg.device == "cuda" else "gloo")
    keep = HfDeepSpeedConfig(ds_cfg)  # HF finds it through a weak reference: keep it alive
    model = AutoModelForCausalLM.from_config(hf_config(cfg.shape), dtype=torch.bfloat16,
                                             attn_implementation="sdpa")
    if not hasattr(next(model.parameters()), "ds_id"):
        raise RuntimeError("transformers did not build the model under deepspeed.zero.Init "
                           "(is accelerate importable?): the ZeRO-3 comparison would be wrong")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_cfg)
    return engine, ds_cfg, keep


def deepspeed_step(engine, device: str):
    """One optimizer step over the given micro-batches. The accumulation boundary is set per
    micro-batch (engine.set_gradient_accumulation_boundary), so one engine serves every
    grad-accum size: set_train_batch_size sets the 1/accum loss scale, the explicit boundary
    replaces DeepSpeed's micro-step counter (which would be misaligned after a size change)."""
    def step(ids, sync):
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i, x in enumerate(ids):
            engine.set_gradient_accumulation_boundary(i == len(ids) - 1)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            total += loss.detach()
        sync()
        t1 = time.perf_counter()
        engine.step()
        sync()
        return float(total) / len(ids), t1 - t0, time.perf_counter() - t1
    return step


def run_deepspeed(cfg: BenchConfig) -> None:
    if cfg.device == "cpu":  # dry run: DeepSpeed's CPU accelerator (gloo, no pinned memory)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        emit("skipped", reason=f"deepspeed is not importable ({e}); benchmarks/run_side_by_side.sh "
                               "installs it from .whl")
        return
    cap_vram(cfg)
    t0 = time.perf_counter()
    engine, ds_cfg, _keep = build_deepspeed(cfg)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    emit("info", **environment(cfg), deepspeed=deepspeed.__version__, params=hf_params(engine.module),
         optimizer=type(optimizer).__name__, ds_config=ds_cfg,
         setup_s=round(time.perf_counter() - t0, 1))
    step = deepspeed_step(engine, cfg.device)

    def measure(mb: int, accum: int) -> dict:
        engine.set_train_micro_batch_size(mb)
        engine.set_train_batch_size(mb * accum)
        reset_vram_peaks(cfg)
        before = engine.global_steps
        times, losses, phases = time_hf_steps(cfg, step, token_ids(cfg, mb, accum))
        return summary(cfg, mb, accum, times, losses,
                       hf_bounding(phases, "GPU compute + parameter fetch (fwd+bwd)",
                                   "CPU Adam + PCIe (step)"), **phases,
                       optimizer_steps=engine.global_steps - before)  # must be warmup + steps

    for accum in cfg.grad_accum:
        guarded("result", cfg, accum, lambda: measure(cfg.micro_batch, accum))
    if cfg.max_batch:
        for mb in cfg.ds_batches:
            if not guarded("max_batch", cfg, 1, lambda: measure(mb, 1), micro_batch=mb):
                break
