"""GGUF import/export round trip on SmolLM2-135M-Instruct: time, peak RSS, size, logit error.

Each import and export runs as its own ``slideformer`` process, so its peak RSS (``wait4``'s
``ru_maxrss``) is that operation's alone. Logits are computed with the engine's dense model in
fp32 on one chat prompt; the error of each exported type is its max |logit difference| from
the imported folder (the source of the export).

    python benchmarks/gguf_roundtrip.py --out /tmp/gguf-bench
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slideformer.engine.gguf.installed import SMOLLM2_INSTALL, smollm2_gguf  # noqa: E402
from slideformer.engine.models.tokenizer import load_tokenizer  # noqa: E402
from slideformer.engine.train.demo import load_dense  # noqa: E402

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def run_cli(*args: str) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one ``slideformer`` command in a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "slideformer.engine.cli", *args], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: slideformer {' '.join(args)}")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024


@torch.no_grad()
def logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    return load_dense(model_dir).logits(ids)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="empty working folder")
    ap.add_argument("--types", default="bf16,f16,q8_0,q4_0")
    a = ap.parse_args()
    src = smollm2_gguf()
    if src is None:
        raise SystemExit(f"SmolLM2 is not installed: {SMOLLM2_INSTALL}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    imported = out / "imported"
    t, rss = run_cli("import-gguf", str(src), "--out", str(imported))
    size = sum(p.stat().st_size for p in imported.iterdir()) / 2**20
    print(f"import  {src.name} ({src.stat().st_size / 2**20:.1f} MiB): {t:.1f} s, "
          f"peak RSS {rss:.0f} MiB, folder {size:.1f} MiB")
    tok = load_tokenizer(imported)
    ids = torch.tensor([tok.encode(tok.render_chat(PROMPT, add_generation_prompt=True))])
    ref = logits(imported, ids)
    print(f"{'type':>6} {'export s':>9} {'RSS MiB':>8} {'file MiB':>9} {'re-import s':>11} "
          f"{'max|dlogit|':>11} {'same top-1':>10}")
    for kind in a.types.split(","):
        f = out / f"smol-{kind}.gguf"
        te, re_ = run_cli("export-gguf", str(imported), "--type", kind, "--out", str(f))
        ti, _ = run_cli("import-gguf", str(f), "--out", str(out / f"back-{kind}"))
        got = logits(out / f"back-{kind}", ids)
        same = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        print(f"{kind:>6} {te:9.1f} {re_:8.0f} {f.stat().st_size / 2**20:9.1f} {ti:11.1f} "
              f"{float((got - ref).abs().max()):11.4f} {same:10.0%}")


if __name__ == "__main__":
    main()
