"""How far bf16 training lands from fp32 training: our engine against standard autocast.

For a tiny random model of each family, the same batches and AdamW settings (global-norm clipping
on) are trained four ways on the CPU:

- ``fp32``: the engine in fp32 (equal to dense fp32 PyTorch AdamW: tests/engine/runtime/test_sliding_equivalence.py);
- ``ours``: the engine in bf16 (bf16 weights and compute, exact fp32 master, fp32 moments);
- ``autocast``: dense PyTorch, fp32 parameters, the forward under torch.autocast(bfloat16), fp32
  AdamW: what most trainers do;
- ``autocast_bf16_residual`` (diagnosis): autocast with the residual stream rounded to bf16 after
  the embedding and after each layer, as our engine keeps it.

Each run's distance to ``fp32``: final weights ``|W - W_fp32| / |W_fp32 - W_0|`` (relative to how
far training moved them) and the loss trajectory ``rms(loss - loss_fp32) / rms(loss_fp32 - loss_fp32[0])``.
Prints one JSON line per family with the distances and ours / autocast ratios.

    python benchmarks/precision.py                   # all families, 40 steps
    python benchmarks/precision.py --steps 10 --families qwen3
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slideformer.engine.config import OptimConfig  # noqa: E402
from slideformer.engine.models.spec import load_spec  # noqa: E402
from slideformer.engine.models.tiny import TinyShape, make_tiny_model  # noqa: E402
from slideformer.engine.models.weights import item_names  # noqa: E402
from slideformer.engine.runtime.backend import CpuBackend  # noqa: E402
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor  # noqa: E402
from slideformer.engine.runtime.host_state import AdamHyper  # noqa: E402
from slideformer.engine.train.schedule import lr_at  # noqa: E402
from slideformer.engine.train.state import build_host_state, load_weights  # noqa: E402
from tests.engine.runtime.test_sliding_equivalence import DenseReference, make_batches  # noqa: E402

OPTIM = OptimConfig(lr=3e-3, weight_decay=0.05, schedule="cosine", warmup_steps=2, max_grad_norm=1.0)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def engine_run(spec, d, steps, dtype):
    """(losses, flat fp32 master of every item) of the engine in ``dtype``."""
    backend = CpuBackend()
    host = build_host_state(spec, backend, dtype, torch.float32, layer_grads=True)
    load_weights(host, spec, d)
    B, T = steps[0][0].input_ids.shape
    ex = SlidingExecutor(spec, backend, host, ExecShape(micro_batch=B, seq_len=T,
                                                        n_micro=len(steps[0]), slots=2), dtype)
    losses = []
    for k, mbs in enumerate(steps, start=1):
        hyper = lambda coef, k=k: AdamHyper(lr_at(k, len(steps), OPTIM), OPTIM.beta1, OPTIM.beta2,  # noqa: E731
                                            OPTIM.eps, OPTIM.weight_decay, k, coef)
        losses.append(ex.train_step(mbs, hyper, OPTIM.max_grad_norm).loss)
    ex.close()
    return losses, torch.cat([host[n].master() for n in item_names(spec)])


def reference_run(spec, d, steps, residual=None):
    """(losses, flat weights) of dense autocast training (``residual``: see the module docstring)."""
    ref = DenseReference(spec, d, OPTIM, autocast=True, residual=residual)
    losses = [ref.step(mbs, k, len(steps)) for k, mbs in enumerate(steps, start=1)]
    return losses, torch.cat([ref.flat(n) for n in item_names(spec)])


def distances(run, fp32, w0) -> dict[str, float]:
    (losses, w), (ref_losses, ref_w) = run, fp32
    lo, rl = torch.tensor(losses), torch.tensor(ref_losses)
    return {"weights": ((w - ref_w).norm() / (ref_w - w0).norm()).item(),
            "loss": ((lo - rl).square().mean().sqrt() / (rl - rl[0]).square().mean().sqrt()).item()}


def family(arch: str, n_steps: int, root: Path) -> dict:
    d = make_tiny_model(root / arch, arch, TinyShape(layers=4, tie=(arch == "qwen2")), seed=3)
    spec = load_spec(d)
    batches = make_batches(spec, 2, B=2, T=32, seed=4)  # 5 distinct steps, cycled
    steps = [batches[k % len(batches)] for k in range(n_steps)]
    w0 = DenseReference(spec, d, OPTIM)
    w0 = torch.cat([w0.flat(n) for n in item_names(spec)])
    fp32 = engine_run(spec, d, steps, torch.float32)
    runs = {"ours": engine_run(spec, d, steps, torch.bfloat16),
            "autocast": reference_run(spec, d, steps),
            "autocast_bf16_residual": reference_run(spec, d, steps, torch.bfloat16)}
    out = {name: distances(r, fp32, w0) for name, r in runs.items()}
    return {"family": arch, "steps": n_steps, "distance_to_fp32": out,
            "ours_over_autocast": {k: out["ours"][k] / out["autocast"][k] for k in ("weights", "loss")},
            "fp32_loss_first_last": [fp32[0][0], fp32[0][-1]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.families:
            print(json.dumps(family(arch, a.steps, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
