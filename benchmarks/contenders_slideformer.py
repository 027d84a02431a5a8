"""The slideformer contender: SlideFormer's public code over a random-init HF Llama
(benchmarks/contenders.py)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from contenders_common import (LR, BenchConfig, cap_vram, emit, environment, guarded, hf_config,
                               hf_params, reset_vram_peaks, summary, token_ids)


SLIDEFORMER_DIR = Path(__file__).resolve().parents[1] / ".contenders" / "SlideFormer"
"""SlideFormer's public code (github.com/RegiaYoung/SlideFormer, Apache-2.0): a checkout, or only the
files its offloader imports, kept out of the repository (git-ignored); benchmarks/run_side_by_side.sh
says how to get it there."""


def _slideformer_importable() -> str | None:
    """Why SlideFormer cannot run here, or None."""
    if not (SLIDEFORMER_DIR / "offload_transformer.py").is_file():
        return (f"no SlideFormer checkout at {SLIDEFORMER_DIR.name}/ under .contenders/ "
                "(git clone https://github.com/RegiaYoung/SlideFormer .contenders/SlideFormer)")
    try:
        import liger_kernel  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not importable ({e}); run_side_by_side.sh installs it from .whl"
    return None


def _allow_cache_position() -> None:
    """SlideFormer's mask helper passes ``cache_position=`` to transformers' create_causal_mask,
    which transformers 5 no longer takes; the mask does not depend on it without a KV cache."""
    from transformers import masking_utils
    original = masking_utils.create_causal_mask

    def create_causal_mask(*args, cache_position=None, **kwargs):
        return original(*args, **kwargs)
    masking_utils.create_causal_mask = create_causal_mask


def build_slideformer(cfg: BenchConfig):
    """SlideFormer's offloader over a random-init HF Llama with Liger's kernels (its benchmark's
    defaults: bf16, LayerAdam on the CPU with fp32 states, no NVMe), attention through SDPA
    (flash-attn is not installed on the reference machine). Its per-layer timers stay off (its
    benchmark turns them on): they add stream synchronisations and print a table every step."""
    sys.path.insert(0, str(SLIDEFORMER_DIR))
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from offload_transformer import SlideFormerOffloader
    from transformers import AutoModelForCausalLM
    _allow_cache_position()
    apply_liger_kernel_to_llama()  # what AutoLigerKernelForCausalLM does for a Llama checkpoint
    model = AutoModelForCausalLM.from_config(hf_config(cfg.shape), dtype=torch.bfloat16,
                                             attn_implementation="sdpa")
    layers = len(model.get_decoder().layers)
    offload_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "slideformer_offload"
    optimizer = dict(lr=LR, bias_correction=True, weight_decay=0.0, eps=1e-8,
                     fp32_optimizer_state=True, num_layer=layers + 2, nvme_offload_fraction=0.0,
                     offload_dir=str(offload_dir), prefetch=True)
    return SlideFormerOffloader(model=model, device=torch.device("cuda:0"), dtype=torch.bfloat16,
                                ac_offload_nvme=False, offload_dir=str(offload_dir),
                                enable_timing=False, enable_memory_stats=False,
                                optimizer_kwargs=optimizer), model


def run_slideformer(cfg: BenchConfig) -> None:
    why = _slideformer_importable() if cfg.device == "cuda" else "SlideFormer needs CUDA"
    if why:
        emit("skipped", reason=why)
        return
    cap_vram(cfg)
    t0 = time.perf_counter()
    offloader, model = build_slideformer(cfg)
    offloader.train()
    emit("info", **environment(cfg), params=hf_params(model), source=str(SLIDEFORMER_DIR.name),
         setup_s=round(time.perf_counter() - t0, 1))
    for accum in cfg.grad_accum:
        # no gradient accumulation in SlideFormer: the same tokens/step as one micro-batch
        mb = cfg.micro_batch * accum
        guarded("result", cfg, accum, lambda: slideformer_row(cfg, offloader, mb, accum))


def slideformer_row(cfg: BenchConfig, offloader, mb: int, accum: int) -> dict:
    """Warm-up + timed steps of ``mb`` sequences; one step is one call of the offloader (its
    forward runs the loss, the backward and waits for every layer's CPU update, as its own
    benchmark script times it), then the GPU is synchronised."""
    (ids,) = token_ids(cfg, mb, 1)
    ones = torch.ones_like(ids)
    reset_vram_peaks(cfg)
    times, losses = [], []
    for _ in range(cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        out = offloader(input_ids=ids, attention_mask=ones, labels=ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(out.loss))
    row = summary(cfg, mb, 1, times, losses, f"not measured; ran as one micro-batch of {mb} "
                                             "(no gradient accumulation)")
    return dict(row, grad_accum=accum)  # the table's row for this many tokens/step
