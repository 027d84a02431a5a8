"""``slideformer plan --gpus N``: each GPU's plan, the host state counted once, the speed model."""
from __future__ import annotations

import json

import pytest

from slideformer.engine import config as config_mod
from slideformer.engine.cli import main
from slideformer.engine.dist.plan import plan_gpus
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan.planner import plan_run

LLAMA_3B = {"model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
            "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "head_dim": 128}
STATE = ("bfloat16 weights", "weight remainders", "AdamW moments m, v", "gradient buffers")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3b")
    (d / "config.json").write_text(json.dumps(LLAMA_3B))
    return d


def cfg_for(d, gpus: int):
    return config_mod.from_dict({"model": {"path": str(d)}, "data": {"max_seq_len": 1024},
                                 "train": {"micro_batch": 4, "grad_accum": 8, "gpus": gpus},
                                 "budget": {"vram": "24GiB", "ram": "256GiB", "gpu_layers": 0}})


def host_bytes(plan, purposes) -> int:
    return sum(a.bytes for a in plan.allocations if a.tier == "host" and a.purpose in purposes)


def test_two_gpus_share_one_host_state(shapes):
    spec = load_spec(shapes)
    one = plan_run(cfg_for(shapes, 1), spec, hardware="rtx4090")
    two = plan_gpus(cfg_for(shapes, 2), spec, 2, "rtx4090")
    assert two.per_gpu.exec_shape.n_micro == 4  # each GPU runs half the micro-batches
    state = host_bytes(one, STATE)
    assert state >= 16 * spec.num_params  # weights, remainders, moments, gradients
    assert host_bytes(two.per_gpu, STATE) == state  # the same state, not a half or a copy
    assert state <= two.host_shared < state + spec.num_params * 1  # + the load buffer
    one_total = sum(a.bytes for a in one.allocations if a.tier == "host")
    assert two.host_peak == two.host_shared + 2 * two.host_per_rank
    assert two.host_peak < 1.2 * one_total < 2 * one_total  # not N copies of the state
    hidden = lambda p: sum(a.bytes for a in p.allocations  # noqa: E731
                           if a.tier == "gpu" and a.purpose == "hidden states or their grads")
    assert 2 * hidden(two.per_gpu) == hidden(one)  # half the micro-batches' activations per GPU
    # speed: the per-GPU step plus the gradient all-reduce (2 (N-1)/N x 4 B per parameter)
    link = min(one.hardware.h2d_gbs, one.hardware.d2h_gbs) * 1e9
    assert two.allreduce_s == pytest.approx(4 * spec.num_params / link)
    assert two.step_time == pytest.approx(two.per_gpu.speed.step_time + two.allreduce_s)
    assert two.tokens_per_s == pytest.approx(one.tokens_per_step / two.step_time)


def test_cli_plan_gpus(shapes, capsys):
    assert main(["plan", "--model", str(shapes), "--gpu", "rtx4090", "--ram", "256GiB",
                 "--grad-accum", "8", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "On 2 GPUs" in out and "shared memory" in out
    assert main(["plan", "--model", str(shapes), "--gpu", "rtx4090", "--grad-accum", "3",
                 "--gpus", "2"]) == 2
    assert "train.grad_accum" in capsys.readouterr().err
