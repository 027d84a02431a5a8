"""Tokenization throughput of ``prepare_data`` on a large JSONL file, with a fresh cache.

Generates a deterministic JSONL of plain-text records (``--size-mb``, default 200), tokenizes it
with a tiny model's tokenizer through :func:`engine.data.prepare_data` into an empty cache, and
prints MB/s. For context it also prints the bare tokenizer's speed on the same text
(``encode_batch_fast`` alone, the ceiling of any pipeline) and the time of cached re-opens.

    python benchmarks/tokenize_throughput.py [--size-mb 200] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.config import DataConfig
from engine.data import prepare_data
from engine.events import Progress
from engine.models.tiny import make_tiny_model, synthetic_corpus
from engine.models.tokenizer import load_tokenizer


def write_corpus(path: Path, size_mb: float, seed: int = 0) -> int:
    """A JSONL of {"text": ...} records of 4-40 corpus lines each; returns its size in bytes."""
    lines = np.array(synthetic_corpus(20000, seed), dtype=object)
    rng = np.random.default_rng(seed)
    target, written = int(size_mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            chunk = []
            for n in rng.integers(4, 41, size=1000):
                text = " ".join(lines[rng.integers(0, len(lines), size=n)])
                chunk.append(json.dumps({"text": text}) + "\n")
            block = "".join(chunk)
            f.write(block)
            written += len(block.encode())
    return path.stat().st_size


def bare_tokenizer_mb_s(tok, path: Path, sample_mb: float = 16) -> float:
    """MB/s of the tokenizer alone (no reading, parsing or storing) on the file's first MBs."""
    texts, size = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line.encode())
            if size >= sample_mb * 1e6:
                break
    start = time.perf_counter()
    tok.tok.encode_batch_fast(texts, add_special_tokens=True)
    return size / 1e6 / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--workdir", default=None, help="where to write the model, data and cache")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tok-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not model.exists():
        make_tiny_model(model)
    tok = load_tokenizer(model)
    data = work / "corpus.jsonl"
    start = time.perf_counter()
    size = write_corpus(data, a.size_mb)
    print(f"corpus: {size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s ({data})")

    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    cfg = DataConfig(train=str(data), max_seq_len=2048)
    progress = []
    start = time.perf_counter()
    prepared = prepare_data(cfg, tok, cache, emit=lambda ev: isinstance(ev, Progress)
                            and progress.append(ev))
    cold = time.perf_counter() - start
    warm = []
    for _ in range(2):  # the first re-open may hash the file (it was written seconds ago)
        start = time.perf_counter()
        again = prepare_data(cfg, tok, cache)
        warm.append(time.perf_counter() - start)
    s = prepared.stats
    print(f"tokens: {s.tokens:,} in {s.train_sequences:,} sequences of {s.seq_len} "
          f"({100 * s.fill:.1f}% filled), {len(progress)} progress events")
    print(f"prepare_data, fresh cache: {cold:.1f} s = {size / 1e6 / cold:.1f} MB/s")
    print(f"prepare_data, cached:      {warm[0]:.3f} s, then {warm[1]:.3f} s "
          f"(from_cache={again.stats.from_cache})")
    print(f"bare tokenizer ceiling:    {bare_tokenizer_mb_s(tok, data):.1f} MB/s")


if __name__ == "__main__":
    main()
