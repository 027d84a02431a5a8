"""How far bf16 training lands from fp32 training: our two precision settings against autocast.

For a tiny random model of each family, the same batches and AdamW settings (global-norm clipping
on) are trained these ways on the CPU:

- ``fp32``: the engine in fp32 (equal to dense fp32 PyTorch AdamW:
  tests/engine/runtime/test_sliding_equivalence.py);
- ``bf16``: the engine with ``train.precision = "bf16"`` (bf16 weights, compute and residual
  stream, exact fp32 master, fp32 moments);
- ``fp8``: the engine with ``train.precision = "fp8"`` (as bf16, the decoder layers'
  projections' forward and input gradient in row-wise FP8, emulated by the CPU's
  ``torch._scaled_mm``: the same roundings as the GPU's, accumulation order aside);
- ``autocast_setting``: the engine with ``train.precision = "autocast"`` (bf16 matmuls, fp32
  residual stream, checkpoints, norm weights and RoPE);
- ``autocast``: dense PyTorch, fp32 parameters, the forward under torch.autocast(bfloat16), fp32
  AdamW: what most trainers do;
- ``autocast_bf16_residual`` (diagnosis): autocast with the residual stream rounded to bf16 after
  the embedding and after each layer, as the bf16 setting keeps it.

Each run's distance to ``fp32`` (tests/engine/runtime/test_precision.py): final weights
``|W - W_fp32| / |W_fp32 - W_0|`` and the loss trajectory
``rms(loss - loss_fp32) / rms(loss_fp32 - loss_fp32[0])``. Prints one JSON line per family with
the distances and each setting's ratio to autocast's.

    python benchmarks/precision.py                   # all families, 12 steps
    python benchmarks/precision.py --steps 40 --families qwen3
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.runtime.test_precision import (FAMILIES, distances, engine_run,  # noqa: E402
                                                 family_setup, reference_run)


def family(arch: str, n_steps: int, root: Path) -> dict:
    spec, d, steps, w0 = family_setup(arch, n_steps, root)
    fp32 = engine_run(spec, d, steps, torch.float32)
    runs = {"bf16": engine_run(spec, d, steps, torch.bfloat16),
            "fp8": engine_run(spec, d, steps, torch.bfloat16, fp8=True),
            "autocast_setting": engine_run(spec, d, steps, torch.bfloat16, torch.float32),
            "autocast": reference_run(spec, d, steps),
            "autocast_bf16_residual": reference_run(spec, d, steps, torch.bfloat16)}
    out = {name: distances(r, fp32, w0) for name, r in runs.items()}
    ratio = lambda run: {k: out[run][k] / out["autocast"][k] for k in ("weights", "loss")}  # noqa: E731
    return {"family": arch, "steps": n_steps, "distance_to_fp32": out,
            "bf16_over_autocast": ratio("bf16"), "fp8_over_autocast": ratio("fp8"),
            "autocast_setting_over_autocast": ratio("autocast_setting"),
            "fp32_loss_first_last": [fp32[0][0], fp32[0][-1]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.families:
            print(json.dumps(family(arch, a.steps, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
