"""The kernel path a run takes, and what the planner's memory and speed make of it (CPU only).

One decision (kernels.dispatch.kernel_path) serves the ops' dispatch, the executor's masks and
the planner: checked here for every device, switch and head dimension, against the predicates
the ops and the masks ask; the speed model's reference efficiencies against the layer timings
they cite; a measured efficiency in the profile winning over them; the memory rows and the plan
report following the path. The fused kernels themselves need a GPU (triton is not installed
here): the CUDA test of these byte counts is tests/engine/plan/test_plan_memory_gpu.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from slideformer.engine.config import RunConfig, override
from slideformer.engine.errors import UserError
from slideformer.engine.kernels import attention, dispatch
from slideformer.engine.kernels.dispatch import PATHS, kernel_path
from slideformer.engine.models.spec import load_spec, spec_from_config
from slideformer.engine.plan import REFERENCE, plan_run
from slideformer.engine.plan import memory as M
from slideformer.engine.plan import transients as TR
from slideformer.engine.plan.bench import kernel_switches, time_layer_paths
from slideformer.engine.plan.hardware import HardwareProfile, read_profile, save_profile
from slideformer.engine.plan.report import format_plan
from slideformer.engine.plan.speed import HEAD_EFFICIENCY, LAYER_EFFICIENCY, estimate, layer_flops
from slideformer.engine.plan.targets import load_profile
from slideformer.engine.runtime.shapes import ExecShape
from test_plan import model_folder

BF16, F32 = torch.bfloat16, torch.float32
CONFIGS = Path(__file__).parents[2] / "fixtures" / "configs"


def shape_spec(name: str):
    return spec_from_config(json.loads((CONFIGS / f"{name}.json").read_text()))


@pytest.fixture
def triton_here(monkeypatch):
    """triton importable, as in CUDA builds of PyTorch (it is not installed on this machine)."""
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.delenv(attention.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("triton,flex,hd,packed,key", [
    ("1", "1", 128, True, "fused+flex"), ("1", "1", 128, False, "fused+causal"),
    ("1", "0", 128, True, "fused+mask"), ("0", "1", 128, True, "torch+flex"),
    ("0", "0", 64, True, "torch+mask"), ("0", "1", 64, False, "torch+causal"),
    ("1", "1", 80, True, "fused+mask"),  # FlexAttention wants a power-of-two head dimension
    ("1", "1", 8, True, "fused+mask")])
def test_cuda_runs_take_the_path_the_switches_and_head_dimension_allow(
        triton_here, monkeypatch, triton, flex, hd, packed, key):
    monkeypatch.setenv(dispatch.ENV, triton)
    monkeypatch.setenv(attention.ENV, flex)
    path = kernel_path("cuda", hd, packed)
    assert path.key == key
    assert path.fused_ops == dispatch.fused_ops_on("cuda") == (triton == "1")
    assert path.fused_ce == path.fused_ops  # one switch, one triton
    assert (path.attention == "flex") == (packed and attention.flex_available("cuda", hd))


def test_the_cpu_backend_keeps_pytorch_ops_and_the_boolean_mask(triton_here):
    assert kernel_path("cpu", 128, True).key == "torch+mask"
    assert kernel_path("cpu", 128, False).key == "torch+causal"
    x = torch.zeros(2, 4)
    assert dispatch.use_triton(x) == kernel_path("cpu", 128, False).fused_ops
    doc = torch.tensor([[0, 0, 1, 1]])
    assert isinstance(attention.document_mask(doc, 128), torch.Tensor)  # what the executor uses


def test_without_triton_cuda_runs_take_pytorch_ops(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    monkeypatch.delenv(attention.ENV, raising=False)
    path = kernel_path("cuda", 128, True)
    assert path.key == "torch+flex" and not path.fused_ce


def test_reference_efficiencies_follow_the_layer_timings_they_cite():
    """speed.py derives them from layer_profile.py's times of one Llama-3.2-3B layer at
    micro-batch 64 x 1024 on the H200 (759 TFLOP/s matmul): recomputed here from the times."""
    spec = shape_spec("llama-3.2-3b")
    f, b = layer_flops(spec, ExecShape(micro_batch=64, seq_len=1024, n_micro=1, slots=2))
    times = {"torch+causal": (29.3, 88.9), "fused+causal": (21.9, 67.5),
             "torch+mask": (31.0, 94.9), "fused+flex": (21.3, 66.2)}
    for key, (tf, tb) in times.items():
        share = (f + b) / ((tf + tb) * 1e-3) / 759e12
        assert LAYER_EFFICIENCY[key] == pytest.approx(share, abs=0.002)
    assert set(LAYER_EFFICIENCY) == set(PATHS)
    # the unmeasured mixes: the ops' figure times the attention kernel's factor
    e = LAYER_EFFICIENCY
    assert e["fused+mask"] == pytest.approx(e["fused+causal"] * e["torch+mask"] / e["torch+causal"],
                                            abs=0.002)
    assert LAYER_EFFICIENCY["fused+causal"] < LAYER_EFFICIENCY["fused+flex"]


def test_speed_uses_the_paths_efficiency_and_prefers_the_measured_one(triton_here, monkeypatch):
    spec = shape_spec("llama-3.2-3b")
    shape = ExecShape(micro_batch=8, seq_len=1024, n_micro=4, slots=2, checkpoints="gpu")
    f, b = layer_flops(spec, shape)
    # attention at the flash kernels' own rate (plan.speed.FLASH_ATTENTION_RATE), the rest of
    # the layer at the path's efficiency
    from slideformer.engine.plan.speed import FLASH_ATTENTION_RATE, irregular
    att = 4 * irregular(spec, 8, 1024, REFERENCE, "cuda").flash_flops * shape.n_micro * spec.num_layers
    layers = spec.num_layers * (f + b) - att
    flash = att / FLASH_ATTENTION_RATE

    def compute_time(hw, packed):
        est = estimate(spec, shape, M.Precision(BF16, F32), "cuda", True, hw, packed=packed)
        plain = replace(hw, matmul_tflops=hw.matmul_tflops * 2)  # halves every compute term
        est2 = estimate(spec, shape, M.Precision(BF16, F32), "cuda", True, plain, packed=packed)
        compute = est.busy_dict()["gpu compute"] - est2.busy_dict()["gpu compute"]
        return compute, est  # (layers / eff + head / HEAD_EFFICIENCY) / (2 x the matmul rate)
    tokens = shape.micro_batch * shape.seq_len * shape.n_micro
    head = 6.0 * tokens * spec.vocab_size * spec.hidden_size
    for packed, key in ((True, "fused+flex"), (False, "fused+causal")):
        t, est = compute_time(REFERENCE, packed)
        rate = REFERENCE.matmul_tflops * 1e12
        expect = (layers / LAYER_EFFICIENCY[key] + flash + head / HEAD_EFFICIENCY) / rate / 2
        assert t == pytest.approx(expect)
        assert f"assumed {LAYER_EFFICIENCY[key]:.2f} of the matmul peak" in est.kernels
    measured = replace(REFERENCE, layer_efficiency=(("fused+flex", 0.5),))
    t, est = compute_time(measured, True)
    assert t == pytest.approx((layers / 0.5 + flash + head / HEAD_EFFICIENCY) / rate / 2)
    assert est.kernels == ("fused Triton + FlexAttention (document BlockMask), measured 0.50 of "
                           f"the matmul peak; attention at {FLASH_ATTENTION_RATE:.2f} of the matmul "
                           "rate (fitted to a measured long-sequence step)")
    monkeypatch.setenv(dispatch.ENV, "0")  # the switch the run would see: the PyTorch figure
    t, est = compute_time(measured, True)
    assert t == pytest.approx((layers / LAYER_EFFICIENCY["torch+flex"] + flash
                               + head / HEAD_EFFICIENCY) / rate / 2)
    assert estimate(spec, shape, M.Precision(F32, F32), "cpu", True, REFERENCE).kernels == ""


def _rows(allocs, purpose):
    return [a for a in allocs if a.purpose == purpose]


def test_memory_rows_follow_the_path(triton_here, monkeypatch):
    spec = shape_spec("llama-3.2-3b")
    shape = ExecShape(micro_batch=8, seq_len=1024, n_micro=2, slots=2, checkpoints="gpu")
    prec = M.Precision(BF16, F32)
    fused = M.allocations(spec, shape, prec, "cuda", packed=True)
    (masks,) = _rows(fused, "attention masks")
    assert masks.bytes == 2 * 8 * 4 * (4 * 8 * 8 + 4 * 8)  # 8 x 8 blocks of 128 tokens, int32
    assert "fused kernels" in _rows(fused, "layer forward scratch")[0].detail
    monkeypatch.setenv(dispatch.ENV, "0")
    monkeypatch.setenv(attention.ENV, "0")
    ref = M.allocations(spec, shape, prec, "cuda", packed=True)
    assert _rows(ref, "attention masks")[0].bytes == 2 * 8 * 1024 * 1024  # bool (B, 1, T, T)
    for purpose in ("layer forward scratch", "recompute activations", "LM-head chunk and loss"):
        assert _rows(fused, purpose)[0].bytes < _rows(ref, purpose)[0].bytes, purpose
    assert _rows(ref, "recompute activations") == _rows(
        TR.recompute_scratch(spec, 8 * 1024, 8, 1024, prec, True), "recompute activations")


def test_layer_transients_switch_on_the_ops_and_on_the_mask_alone():
    spec = shape_spec("llama-3.2-3b")
    prec, N, B, T = M.Precision(BF16, F32), 8 * 1024, 8, 1024
    by_key = {k: TR.layer_transients(spec, N, B, T, prec, dispatch.KernelPath(
        k.startswith("fused"), k.startswith("fused"), k.split("+")[1])) for k in PATHS}
    mask = B * T * T * 2  # SDPA's additive copy of the boolean mask, bf16
    for ops in ("fused", "torch"):
        causal, flex, masked = (by_key[f"{ops}+{a}"] for a in ("causal", "flex", "mask"))
        assert causal == flex  # a BlockMask costs the layer nothing (counted with the step)
        assert masked[1].bytes == causal[1].bytes + mask  # saved by SDPA for its backward
    assert by_key["torch+causal"] == [TR.forward_scratch(spec, N, B, T, prec, False),
                                      *TR.recompute_scratch(spec, N, B, T, prec, False)]


def test_old_profiles_load_and_a_measured_efficiency_round_trips(tmp_path):
    old = REFERENCE.to_dict()
    del old["layer_efficiency"]
    assert HardwareProfile.from_dict(old).layer_efficiency == ()
    prof = replace(REFERENCE, layer_efficiency=(("fused+flex", 0.79), ("torch+mask", 0.55)))
    path = save_profile(prof, tmp_path / "hw.json")
    assert read_profile(path) == prof
    for bad in ([["fused+flash", 0.8]], [["fused+flex", 0]], [["fused+flex", True]], "0.8",
                [["fused+flex"]]):
        path.write_text(json.dumps(dict(prof.to_dict(), layer_efficiency=bad)))
        with pytest.raises(UserError, match="layer_efficiency"):
            read_profile(path)


def test_a_preset_does_not_inherit_this_gpus_measured_efficiency(tmp_path, monkeypatch):
    mine = replace(REFERENCE, layer_efficiency=(("fused+flex", 0.7),))
    monkeypatch.setattr("slideformer.engine.plan.targets.cache_file", lambda: tmp_path / "hw.json")
    save_profile(mine, tmp_path / "hw.json")
    assert load_profile("this").layer_efficiency == mine.layer_efficiency
    assert load_profile("rtx4090").layer_efficiency == ()


def test_the_plan_names_the_kernels_it_assumed(tmp_path, triton_here):
    cfg = override(RunConfig(), {"data.max_seq_len": 1024, "train.micro_batch": 4,
                                 "budget.vram": "24GiB", "budget.ram": "64GiB",
                                 "train.device": "cuda"})
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    text = format_plan(plan_run(cfg, spec, hardware=REFERENCE))
    assert ("GPU kernels: fused Triton + FlexAttention (document BlockMask), assumed "
            f"{LAYER_EFFICIENCY['fused+flex']:.2f} of the matmul peak") in text
    cpu = format_plan(plan_run(override(cfg, {"train.device": "cpu"}), spec, hardware=REFERENCE))
    assert "GPU kernels" not in cpu


def test_the_bench_times_each_path_this_machine_takes():
    """On the CPU: the PyTorch ops with and without the boolean mask, a positive share each, and
    the switches left as they were."""
    tiny = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128)
    before = {k: os.environ.get(k) for k in (dispatch.ENV, attention.ENV)}
    lines = []
    got = time_layer_paths(1e-6, "cpu", lines.append, repeats=1, config=tiny, tokens=(2, 64))
    assert [k for k, _ in got] == ["torch+causal", "torch+mask"]
    assert all(v > 0 for _, v in got) and len(lines) == 2
    assert {k: os.environ.get(k) for k in before} == before
    with kernel_switches(False, True):
        assert os.environ[dispatch.ENV] == "0" and attention.ENV not in os.environ
    assert {k: os.environ.get(k) for k in before} == before
