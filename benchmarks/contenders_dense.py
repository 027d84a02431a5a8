"""The dense contender: HF LlamaForCausalLM with everything in VRAM (benchmarks/contenders.py)."""
from __future__ import annotations

import contextlib
import time

import torch

from contenders_common import (LR, BenchConfig, emit, environment, guarded, hf_bounding, hf_config,
                               hf_params, reset_vram_peaks, summary, time_hf_steps, token_ids)


def run_dense(cfg: BenchConfig) -> None:
    from transformers import AutoModelForCausalLM
    bf16 = cfg.dense_dtype == "bf16"
    t0 = time.perf_counter()
    with torch.device(cfg.device):
        model = AutoModelForCausalLM.from_config(
            hf_config(cfg.shape), dtype=torch.bfloat16 if bf16 else torch.float32,
            attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, fused=True)
    autocast = (contextlib.nullcontext if bf16 else
                lambda: torch.autocast(cfg.device, dtype=torch.bfloat16))
    emit("info", **environment(cfg), params=hf_params(model), dtype=cfg.dense_dtype,
         setup_s=round(time.perf_counter() - t0, 1))

    def step(ids, sync):
        t0 = time.perf_counter()
        total = torch.zeros((), device=cfg.device)
        for x in ids:
            with autocast():
                loss = model(input_ids=x, labels=x).loss
            (loss / len(ids)).backward()  # equal labelled tokens per micro-batch: the step's mean
            total += loss.detach()
        sync()
        t1 = time.perf_counter()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return float(total) / len(ids), t1 - t0, time.perf_counter() - t1

    for accum in cfg.grad_accum:
        def measure():
            reset_vram_peaks(cfg)
            times, losses, phases = time_hf_steps(cfg, step, token_ids(cfg, cfg.micro_batch, accum))
            where = "GPU compute" if cfg.device == "cuda" else "CPU compute"
            return summary(cfg, cfg.micro_batch, accum, times, losses,
                           hf_bounding(phases, f"{where} (fwd+bwd)", "optimizer step"), **phases)
        guarded("result", cfg, accum, measure)
