"""benchmarks/ceiling.py: its matmul FLOPs against torch's FLOP counter over the layer's forward and
the executor's recompute + backward (models.recompute.layer_backward), and its answer's consistency."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from ceiling import analyse, flops_per_token, matmul_params, saved_bytes_per_token  # noqa: E402
from sliding_step import shape_spec  # noqa: E402

from slideformer.engine.models.layers import decoder_layer, rope_tables  # noqa: E402
from slideformer.engine.models.recompute import layer_backward  # noqa: E402
from slideformer.engine.models.spec import spec_from_config  # noqa: E402
from slideformer.engine.models.tiny import TinyShape, tiny_config  # noqa: E402


def counted_mm(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    counts = fc.get_flop_counts()["Global"]
    return sum(v for k, v in counts.items() if str(k) in ("aten.mm", "aten.addmm"))


def test_matmul_flops_match_torchs_counter_on_the_executors_layer_functions():
    for arch in ("llama", "qwen2", "qwen3"):
        spec = spec_from_config(tiny_config(arch, TinyShape(layers=1)))
        B, T = 2, 24
        g = torch.Generator().manual_seed(0)
        flat = torch.randn(spec.params_per_layer, generator=g) * 0.1
        leaves = {k: v.detach().requires_grad_() for k, v in spec.layer_layout.views(flat).items()}
        x = torch.randn(B, T, spec.hidden_size, generator=g)
        rope = rope_tables(spec, torch.arange(T).expand(B, T), torch.float32)
        with torch.no_grad():
            fwd = counted_mm(lambda: decoder_layer(spec, leaves, x, rope, None))
        bwd = counted_mm(lambda: layer_backward(spec, leaves, x, torch.randn_like(x), rope, None))
        f, tokens = flops_per_token(spec, T), B * T
        att = 2.0 * T * spec.num_heads * spec.head_dim
        head = 2.0 * spec.vocab_size * spec.hidden_size
        assert f.forward - att - head == fwd / tokens, arch
        assert f.backward + f.recompute - 3.5 * att - 2 * head == bwd / tokens, arch
        H, I = spec.hidden_size, spec.intermediate_size
        q = spec.num_heads * spec.head_dim
        assert f.recompute_mlp == 2 * (2 * H * I + q * H) < f.recompute
        assert matmul_params(spec) > 3 * H * I


def test_keeping_the_answered_layer_count_reaches_the_target_and_one_fewer_does_not():
    spec = spec_from_config(tiny_config("llama", TinyShape(layers=8)))
    hw = json.loads((ROOT / "tests/fixtures/hardware/h200.json").read_text())
    f = flops_per_token(spec, 128)
    measured, L = 1000.0, spec.num_layers
    per_layer = f.recompute / L

    def speed(kept):  # GPU-bound: the step's time scales with its FLOPs
        return measured * f.total / (f.total - kept * per_layer)

    for target in (1010.0, 1050.0, speed(L) - 1):
        a = analyse(spec, 4096, 128, measured, 1.0, target, 10.0, hw)
        n = a["layers_to_keep"]
        assert speed(n) >= target and speed(n - 1) < target, (target, n)
        kept = n * 4096 * saved_bytes_per_token(spec)
        assert abs(a["host_gib"] - 10.0 - kept / (1 << 30)) < 0.06
    assert analyse(spec, 4096, 128, measured, 1.0, 900.0, 10.0, hw)["layers_to_keep"] == 0
    beyond = analyse(spec, 4096, 128, measured, 1.0, speed(L) * 1.01, 10.0, hw)
    assert beyond["layers_to_keep"] is None and beyond["best_without_recompute"] == round(speed(L))


def test_the_command_prints_the_default_64k_answer():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ceiling.py")], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    hw = json.loads((ROOT / "tests/fixtures/hardware/h200.json").read_text())
    spec = shape_spec("llama-3.2-3b")
    assert json.loads(out) == analyse(spec, 65536, 1024, 23382, 2.70 / 2.80, 1.2 * 23232, 61.9, hw)
