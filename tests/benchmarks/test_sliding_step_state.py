"""benchmarks/sliding_step.random_state starts a model as its initialisation does: matrices
N(0, 0.02), norm weights at one. With norm weights drawn like the matrices the gradients were
~60x smaller and no step ever clipped, so exact clipping's redone speculative updates never
entered the harness's timings, while a real run (``slideformer train``) does them."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sliding_step import random_state, shape_spec  # noqa: E402

from slideformer.engine.runtime.backend import make_backend  # noqa: E402


def test_norms_start_at_one_and_matrices_at_init_scale():
    spec = shape_spec("tiny")
    host = random_state(spec, make_backend("cpu"), torch.float32)
    norms = matrices = 0
    for item in host.values():
        views = item.layout.views(item.master())
        for name, _, shape in item.layout.entries:
            w = views[name]
            if name.endswith("norm.weight"):
                assert torch.equal(w, torch.ones_like(w)), name
                norms += 1
            elif len(shape) == 2:
                assert 0.015 < float(w.float().std()) < 0.025, name
                matrices += 1
    assert norms == 2 * spec.num_layers + 1 and matrices >= 7 * spec.num_layers
