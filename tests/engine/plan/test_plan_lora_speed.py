"""The frozen-base speed model against the LoRA / QLoRA runs measured on the reference H200.

benchmarks/RESULTS.md, "2026-12-01 (fourth session) — LoRA / QLoRA, Llama-3.1-8B shape, all four
contenders": ours on the H200 capped at 24 GiB, seq 1024, micro-batch 4, all 32 layers in
slots, rank 8 on every projection, no dropout, fused Triton kernels, unpacked rows; the
profile is the one `slideformer bench --hardware` measured there (tests/fixtures/hardware).
The records are data: this test times nothing. Before the adapters' traffic was modelled
(plan.frozen.ADAPTER_BYTES) the model said 13.2-13.6K tok/s for all four.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slideformer.engine.config import LoraConfig
from slideformer.engine.kernels.dispatch import KernelPath
from slideformer.engine.models.lora import lora_spec
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.plan import frozen
from slideformer.engine.plan.allocation import Precision
from slideformer.engine.plan.hardware import read_profile
from slideformer.engine.runtime.executor import ExecShape

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MEASURED = [  # method, grad_accum, checkpoints, tokens/s measured
    ("lora", 4, "host", 10_963), ("qlora", 4, "gpu", 9_824),
    ("lora", 16, "host", 10_960), ("qlora", 16, "host", 10_614)]


@pytest.mark.parametrize("method,accum,ckpt,measured", MEASURED)
def test_frozen_speed_is_within_a_tenth_of_the_h200_runs(method, accum, ckpt, measured, monkeypatch):
    import json
    cfg = json.loads((FIXTURES / "configs" / "llama-3.1-8b.json").read_text())
    spec = spec_from_config(cfg)
    hw = read_profile(FIXTURES / "hardware" / "h200.json")
    monkeypatch.setattr(frozen, "kernel_path", lambda *a: KernelPath(True, True, "causal"))
    shape = ExecShape(micro_batch=4, seq_len=1024, n_micro=accum, slots=32, checkpoints=ckpt)
    prec = Precision(torch.bfloat16, torch.float32)
    est = frozen.frozen_estimate(spec, shape, prec, "cuda", hw, method, lora_spec(LoraConfig()),
                                 packed=False)
    assert abs(est.tokens_per_s / measured - 1) <= 0.10, (est.tokens_per_s, measured)
