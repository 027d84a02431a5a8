"""The parts of a layer the planner times by measurement rather than FLOPs (plan.speed.irregular):
routed experts by (token, expert) pairs x hidden size, the PyTorch gated delta rule by tokens x
value heads, math-path attention by scores, per-head norms in PyTorch ops by their elements; and
the runtime baseline's JIT compilers (plan.memory.runtime_baseline)."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks.shapes import shape_config
from slideformer.engine.kernels.dispatch import KernelPath
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.plan import memory, speed
from slideformer.engine.plan.targets import load_profile

H100 = load_profile("h100")


def spec_of(name: str, **kw):
    return spec_from_config(dict(shape_config(name), **kw))


def flash_s(irr, hw=H100) -> float:
    """The forward seconds of the flash attention term (speed.FLASH_ATTENTION_RATE)."""
    return irr.flash_flops / (speed.FLASH_ATTENTION_RATE * hw.matmul_tflops * 1e12)


def norms_s(spec, B: int, T: int, key: str, hw=H100, fused: bool = False) -> float:
    """The seconds of the per-head norms of the attention layers (speed.HEAD_NORM_S, or
    HEAD_NORM_FUSED_S on the fused path)."""
    attn = [i for i in range(spec.num_layers) if not spec.is_linear(i)]
    per = speed.HEAD_NORM_FUSED_S if fused else speed.HEAD_NORM_S
    return (B * T * speed._head_norm_elements(spec, attn) * per[key]
            * speed.IRREGULAR_REFERENCE_TFLOPS / hw.matmul_tflops)


def test_experts_are_timed_by_pairs_times_hidden_not_by_flops(monkeypatch):
    monkeypatch.setattr(speed, "fla_runs", lambda device: False)
    base = spec_of("qwen3-30b-a3b")
    irr = speed.irregular(base, 4, 1024, H100, "cuda")
    N, k, E = 4096, base.moe.top_k, base.moe.experts
    scale = speed.IRREGULAR_REFERENCE_TFLOPS / H100.matmul_tflops
    ex = irr.fwd - flash_s(irr)  # the experts' share
    assert ex == pytest.approx(N * k * base.hidden_size * speed.EXPERT_PAIR_S[False] * scale)
    assert irr.frozen - 3 * flash_s(irr) == pytest.approx(2.0 * ex)
    assert irr.full - 3 * flash_s(irr) == pytest.approx(2.5 * ex)
    stacked = 3 * E * base.hidden_size * base.moe.width  # gate, up, down of every expert
    assert irr.expert_flops == pytest.approx(2 * stacked * k / E * N)
    assert irr.rule_flops == 0
    wider = spec_of("qwen3-30b-a3b", moe_intermediate_size=4 * 768)  # 4x the FLOPs, same pairs
    assert speed.irregular(wider, 4, 1024, H100, "cuda").fwd == pytest.approx(irr.fwd)
    twice = spec_of("qwen3-30b-a3b", num_experts_per_tok=16)
    assert speed.irregular(twice, 4, 1024, H100, "cuda").fwd == pytest.approx(ex * 2 + flash_s(irr))
    slower = dataclasses.replace(H100, matmul_tflops=H100.matmul_tflops / 4)
    assert speed.irregular(base, 4, 1024, slower, "cuda").fwd == pytest.approx(4 * irr.fwd)
    assert speed.irregular(base, 4, 1024, H100, "cpu") == speed.Irregular()


def test_gpt_oss_experts_take_their_own_layout_figure():
    spec = spec_of("gpt-oss-120b")
    irr = speed.irregular(spec, 4, 1024, H100, "cuda")
    scale = speed.IRREGULAR_REFERENCE_TFLOPS / H100.matmul_tflops
    assert irr.fwd - flash_s(irr) == pytest.approx(4096 * 4 * 2880 * speed.EXPERT_PAIR_S[True] * scale)


@pytest.mark.parametrize("fla", [False, True])
def test_the_delta_rule_is_timed_only_where_fla_does_not_run(monkeypatch, fla):
    monkeypatch.setattr(speed, "fla_runs", lambda device: fla)
    spec = spec_of("qwen3.5-16l")  # 12 gated DeltaNet layers of 16, dense MLPs
    irr = speed.irregular(spec, 4, 1024, H100, "cuda")
    assert irr.flash_flops == pytest.approx(2.0 * 4 * 1024 * 1024 * spec.q_width * 4 / 16)
    attn = {k: norms_s(spec, 4, 1024, k) for k in ("fwd", "frozen")}  # Qwen3.5's offset q/k norms
    assert attn["fwd"] > 0
    if fla:  # only the four attention layers' flash and norm terms
        assert irr.rule_flops == 0 and irr.fwd == pytest.approx(flash_s(irr) + attn["fwd"])
        return
    d, share = spec.linear, 12 / 16
    scale = speed.IRREGULAR_REFERENCE_TFLOPS / H100.matmul_tflops
    token_heads = 4096 * d.num_v_heads * share * scale  # heads of 128 x 128
    assert irr.fwd - flash_s(irr) - attn["fwd"] == pytest.approx(
        token_heads * speed.DELTANET_RULE_S["fwd"])
    assert irr.frozen - 3 * flash_s(irr) - attn["frozen"] == pytest.approx(
        token_heads * speed.DELTANET_RULE_S["frozen"])
    assert irr.rule_flops > 0 and irr.expert_flops == 0


def test_attention_of_heads_wider_than_flash_takes_is_timed_by_its_scores():
    """Gemma 4's full layers (heads of 512) run SDPA's math path: timed per score, their share
    of the widest-layer attention FLOPs left out of the FLOP-timed work; heads of 256 and less
    (the sliding layers, Llama) are not."""
    g = spec_of("gemma-4-31b")
    wide = [i for i in range(g.num_layers) if g.head_dim_of(i) > speed.FLASH_HEAD_DIM]
    assert len(wide) == 10
    irr = speed.irregular(g, 4, 1024, H100, "cuda")
    scale = speed.IRREGULAR_REFERENCE_TFLOPS / H100.matmul_tflops
    scores = 4 * g.num_heads * 1024 * 1024 * scale * 10 / g.num_layers
    n_fwd, n_frozen = norms_s(g, 4, 1024, "fwd"), norms_s(g, 4, 1024, "frozen")
    assert irr.fwd - flash_s(irr) - n_fwd == pytest.approx(scores * speed.SCORE_S["fwd"])
    assert irr.frozen - 3 * flash_s(irr) - n_frozen == pytest.approx(
        scores * speed.SCORE_S["frozen"])
    assert irr.score_flops == pytest.approx(2.0 * 4 * 1024 * 1024 * g.q_width * 10 / g.num_layers)
    assert irr.flash_flops == pytest.approx(2.0 * 4 * 1024 * 1024 * g.q_width * 50 / g.num_layers)
    both = irr.score_flops + irr.flash_flops
    assert irr.flops(frozen=True) == pytest.approx((both, 3 * both))
    llama = speed.irregular(spec_of("llama-3.1-8b"), 4, 1024, H100, "cuda")
    assert llama.score_flops == 0 and llama.fwd == pytest.approx(flash_s(llama))
    # the fused kernel path takes Gemma's norms: their own, smaller, per-element figures
    fused = speed.irregular(g, 4, 1024, H100, "cuda", fused=True)
    assert fused.norms_fused and fused.norm_elements == irr.norm_elements > 0
    assert fused.fwd == pytest.approx(irr.fwd - n_fwd + norms_s(g, 4, 1024, "fwd", fused=True))
    assert fused.frozen < irr.frozen
    # 4x the positions: 16x the scores and the flash FLOPs, 4x the norms' elements
    assert speed.irregular(g, 4, 4096, H100, "cuda").fwd == pytest.approx(
        16 * (irr.fwd - n_fwd) + 4 * n_fwd)


def test_a_moe_layer_plans_slower_than_its_flops_say(monkeypatch):
    """The frozen-base step of Qwen3-30B-A3B on an H100 is GPU-bound; counting its experts by
    FLOPs at the dense layer rate made it 4x too fast (benchmarks/family_layers.py)."""
    from slideformer.engine.config import LoraConfig
    from slideformer.engine.models.lora import for_model, lora_spec
    from slideformer.engine.plan import frozen
    from slideformer.engine.plan.allocation import Precision
    from slideformer.engine.runtime.executor import ExecShape
    import torch
    spec = spec_of("qwen3-30b-a3b")
    monkeypatch.setattr(frozen, "kernel_path", lambda *a: KernelPath(True, True, "causal"))
    shape = ExecShape(micro_batch=4, seq_len=1024, n_micro=4, slots=48, checkpoints="host")
    prec = Precision(torch.bfloat16, torch.float32)
    lora = for_model(lora_spec(LoraConfig()), spec)
    args = (spec, shape, prec, "cuda", H100, "qlora", lora)
    timed = frozen.frozen_estimate(*args)
    monkeypatch.setattr(frozen, "irregular", lambda *a: speed.Irregular())
    by_flops = frozen.frozen_estimate(*args)
    assert timed.busy_dict()["gpu compute"] > 1.5 * by_flops.busy_dict()["gpu compute"]
    assert timed.flops == by_flops.flops  # the model FLOPs reported do not change
    assert "routed experts at their times measured" in timed.kernels  # the plan says so
    assert "routed experts" not in by_flops.kernels


def test_runtime_baseline_adds_the_jit_compilers():
    mib = memory.MiB
    assert memory.runtime_baseline("cpu").bytes == memory.HOST_RUNTIME["cpu"]
    torch_ops = memory.runtime_baseline("cuda", KernelPath(False, False, "mask"))
    assert torch_ops.bytes == memory.HOST_RUNTIME["cuda"] + memory.STEP_MODULES
    fused = memory.runtime_baseline("cuda", KernelPath(True, True, "causal"))
    flex = memory.runtime_baseline("cuda", KernelPath(True, True, "flex"))
    assert fused.bytes - torch_ops.bytes == 100 * mib and flex.bytes - fused.bytes == 300 * mib
    assert "FlexAttention" in flex.detail


def test_a_full_fine_tune_times_its_experts_the_same_way(monkeypatch):
    """The full fine-tune's layer times (plan.speed._times) take the experts by measurement too,
    their backward at EXPERT_PASSES["full"]; the model FLOPs reported stay the same."""
    import torch

    from slideformer.engine.plan.allocation import Precision
    from slideformer.engine.runtime.executor import ExecShape
    spec = spec_of("olmoe-1b-7b")
    shape = ExecShape(micro_batch=4, seq_len=1024, n_micro=4, slots=4, checkpoints="host")
    prec = Precision(torch.bfloat16, torch.float32)
    monkeypatch.setattr(speed, "kernel_path", lambda *a: KernelPath(True, True, "causal"))
    timed = speed.estimate(spec, shape, prec, "cuda", True, H100)
    t = speed._times(spec, shape, prec, H100, 0.0, 0.802, True)
    monkeypatch.setattr(speed, "irregular", lambda *a: speed.Irregular())
    by_flops = speed.estimate(spec, shape, prec, "cuda", True, H100)
    t0 = speed._times(spec, shape, prec, H100, 0.0, 0.802, True)
    assert timed.busy_dict()["gpu compute"] > by_flops.busy_dict()["gpu compute"]
    assert timed.flops == by_flops.flops
    monkeypatch.undo()
    irr = speed.irregular(spec, 4, 1024, H100, "cuda")  # the term the first plan took
    rate = H100.matmul_tflops * 1e12 * 0.802
    e, _ = irr.flops(frozen=False)
    assert t.f - t0.f == pytest.approx(4 * (irr.fwd - e / rate))
    assert t.b - t0.b == pytest.approx(4 * (irr.full - 3 * e / rate))
