"""The contenders of the side-by-side benchmark, each run in a process of its own.

    python3 benchmarks/contenders.py CONTENDER '<BenchConfig as JSON>'

benchmarks/side_by_side.py starts one such process per contender (fresh CUDA context, clean
peaks), samples its process tree's RSS and reads the lines it prints that start with ``MARK``:
one JSON record each, ``kind`` one of

    info       facts about the process (versions, GPU, parameters, set-up time)
    result     one grad-accum size: step times, tokens/s, TFLOP/s, peak VRAM, VmHWM, bottleneck
    max_batch  one try of the largest-micro-batch search at grad_accum 1
    error      one size that failed (out of memory, ...); the process goes on with the next
    skipped    the contender cannot run here (no GPU, no DeepSpeed)

Everything else on stdout/stderr (DeepSpeed's logging) is noise to the reader.

Contenders, all on the same random-init Llama shape and the same seeded token ids:
    dense      HF LlamaForCausalLM, all in VRAM: fp32 master weights, bf16 autocast, gradient
               checkpointing, SDPA, torch AdamW(fused) on the GPU; uncapped
    resident   our engine as the planner shapes it for the whole GPU: every layer, its master
               weights and moments in VRAM and updated there (dense training in our engine);
               uncapped (on the CPU backend: K = L slots)
    deepspeed  DeepSpeed ZeRO-3, parameters and optimizer offloaded to CPU (DeepSpeedCPUAdam),
               bf16, HF model with gradient checkpointing built under zero.Init; VRAM capped
    slideformer  SlideFormer's public code (github.com/RegiaYoung/SlideFormer, Apache-2.0; a
               checkout in the git-ignored .contenders/SlideFormer, never part of the package):
               its offloader over a random-init HF Llama with Liger's fused kernels, SDPA, CPU
               LayerAdam overlapped with the backward, no clipping; no gradient accumulation,
               so each grad-accum size runs as one micro-batch of micro_batch * grad_accum
               sequences (the same tokens/step); VRAM capped
    sliding    our engine as the planner shapes it for the cap (slots, checkpoint placement,
               device optimizer for spare VRAM), or K = --slots with every update on the CPU;
               VRAM capped

Every contender trains on micro_batch * (seq - 1) labelled tokens per micro-batch (HF shifts
``labels = input_ids`` inside its loss; ours gets the shifted labels with the last position
unlabelled, sliding_step.random_batches). Tokens/step and TFLOP/s count all micro_batch * seq
positions, as compute does.

Each contender lives in a module of its own (contenders_dense, contenders_deepspeed,
contenders_slideformer, contenders_ours for resident and sliding) over contenders_common (the
configuration, the records, a result row's figures); this file only dispatches.
"""
from __future__ import annotations

import sys

from contenders_common import CONTENDERS, BenchConfig, emit
from contenders_deepspeed import run_deepspeed
from contenders_dense import run_dense
from contenders_ours import run_ours
from contenders_slideformer import run_slideformer


def main() -> None:
    contender, cfg = sys.argv[1], BenchConfig.from_json(sys.argv[2])
    if contender not in CONTENDERS:
        raise SystemExit(f"contenders.py: unknown contender {contender!r}; use one of {CONTENDERS}")
    if contender == "dense":
        run_dense(cfg)
    elif contender == "deepspeed":
        run_deepspeed(cfg)
    elif contender == "slideformer":
        run_slideformer(cfg)
    else:
        run_ours(cfg, contender)
    emit("done")


if __name__ == "__main__":
    main()
