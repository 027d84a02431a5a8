"""Latency of the data preview (what the Data page shows first) against the size of a record.

Writes plain-text files without blank lines (one paragraph, as a book or a scraped page often
is) of growing size, and a JSONL file of large records, and times ``slideformer.engine.data.preview`` on
each with the tiny model's tokenizer, 5 records, ``max_seq_len`` 1024. A linear preview keeps
ms/MB flat as the size grows.

    python benchmarks/preview_latency.py [--sizes-kb 150 600 2400] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from slideformer.engine.config import DataConfig
from slideformer.engine.data import preview
from slideformer.engine.models.tiny import make_tiny_model, synthetic_corpus
from slideformer.engine.models.tokenizer import load_tokenizer


def text_of_size(size_kb: float, seed: int = 0) -> str:
    lines, out, n = synthetic_corpus(5000, seed), [], 0
    while n < size_kb * 1000:
        line = lines[len(out) % len(lines)]
        out.append(line)
        n += len(line) + 1
    return "\n".join(out)


def timed(cfg: DataConfig, tok, repeats: int = 3) -> float:
    """Best of ``repeats`` wall-clock seconds of one preview."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        preview(cfg, tok, 5)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kb", type=float, nargs="+", default=[150, 600, 2400])
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="preview-bench-"))
    model = work / "model"
    if not model.exists():
        make_tiny_model(model)
    tok = load_tokenizer(model)
    print(f"{'file':<34} {'size':>9} {'preview':>10} {'ms/MB':>8}")
    for kb in a.sizes_kb:
        text = text_of_size(kb)
        txt = work / f"para-{int(kb)}k.txt"
        txt.write_text(text + "\n", encoding="utf-8")
        big = work / f"records-{int(kb)}k.jsonl"
        big.write_text("".join(json.dumps({"text": text[i::5]}) + "\n" for i in range(5)),
                       encoding="utf-8")
        for path in (txt, big):
            mb = path.stat().st_size / 1e6
            s = timed(DataConfig(train=str(path)), tok)
            print(f"{path.name:<34} {mb:>7.2f}MB {1e3 * s:>8.0f}ms {1e3 * s / mb:>8.0f}")


if __name__ == "__main__":
    main()
