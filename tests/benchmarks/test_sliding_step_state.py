"""benchmarks/sliding_step.random_state starts a model as its initialisation does: matrices
N(0, 0.02), and every tensor that scales by its values at the value that leaves its input
unchanged (norms at one, or zero where a family scales by 1 + w; DeltaNet's gated norm and
Gemma 4's layer and router scales at one). With those drawn like the matrices the gradients were
~60x smaller and no step ever clipped, so exact clipping's redone speculative updates never
entered the harness's timings, while a real run (``slideformer train``) does them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sliding_step import random_state, shape_spec  # noqa: E402

from slideformer.engine.runtime.backend import make_backend  # noqa: E402

SCALE_NAMES = ("norm.weight", "norm_1.weight", "norm_2.weight", "layer_scalar", "router.scale",
               "router.per_expert_scale")


@pytest.mark.parametrize("shape, unit", [("tiny", {"input_layernorm.weight": 1.0}),
                                         ("small-qwen3.5", {"input_layernorm.weight": 0.0,
                                                            "linear_attn.norm.weight": 1.0}),
                                         ("small-gemma4", {"input_layernorm.weight": 1.0,
                                                           "layer_scalar": 1.0})])
def test_scales_start_where_they_change_nothing_and_matrices_at_init_scale(shape, unit):
    spec = shape_spec(shape)
    host = random_state(spec, make_backend("cpu"), torch.float32)
    seen, matrices = {}, 0
    for item in host.values():
        views = item.layout.views(item.master())
        for name, _, shape_ in item.layout.entries:
            w = views[name]
            if name.endswith(SCALE_NAMES):
                assert torch.all(w == w.flatten()[0]), name  # a constant
                seen[name] = float(w.flatten()[0])
            elif len(shape_) == 2 and w.numel() > 64:
                assert 0.015 < float(w.float().std()) < 0.025, name
                matrices += 1
    assert matrices >= 4 * spec.num_layers
    for name, value in unit.items():
        assert seen[name] == value, name
