"""Tokenization throughput of ``prepare_data`` on a large JSONL file, with a fresh cache.

Generates a deterministic JSONL of plain-text records (``--size-mb``, default 200), tokenizes it
with a tiny model's tokenizer through :func:`slideformer.engine.data.prepare_data` into an empty cache, and
prints MB/s. For context it also prints the bare tokenizer's speed on the same text
(``encode_batch_fast`` alone, the ceiling of any pipeline) and the time of cached re-opens.

``--vocab N`` replaces the tiny model's 384-token vocabulary by a byte-level BPE of N tokens
(the Llama 3 / GPT-2 kind) trained here, with the ``tokenizers`` library, on the Python standard
library's source text; ``--corpus stdlib`` tokenizes records cut from that text instead of the
synthetic corpus. ``--processes P`` forces P worker processes (0: the one helper thread);
by default the engine chooses (processes on >= 8 cores for sources >= 64 MB).

    python benchmarks/tokenize_throughput.py [--size-mb 200] [--vocab 32000] [--corpus stdlib]
                                             [--processes P] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

import slideformer.engine.data.tokenize as tokenize_mod
from slideformer.engine.config import DataConfig
from slideformer.engine.data import prepare_data
from slideformer.engine.events import Progress
from slideformer.engine.models.tiny import make_tiny_model, synthetic_corpus
from slideformer.engine.models.tokenizer import load_tokenizer


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


def stdlib_text(limit_mb: float = 24) -> list[str]:
    """Paragraphs of the Python standard library's sources (real words, code and prose)."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.extend(p for p in text.split("\n\n") if p.strip())
        size += len(text)
        if size >= limit_mb * 1e6:
            break
    return out


def write_stdlib_corpus(path: Path, size_mb: float, seed: int = 0) -> int:
    """A JSONL of {"text": ...} records of 1-12 stdlib paragraphs each."""
    paras = np.array(stdlib_text(), dtype=object)
    rng = np.random.default_rng(seed)
    target, written = int(size_mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            block = "".join(json.dumps({"text": "\n\n".join(paras[rng.integers(0, len(paras),
                                                                          size=n)])}) + "\n"
                            for n in rng.integers(1, 13, size=1000))
            f.write(block)
            written += len(block.encode())
    return path.stat().st_size


def real_vocab_model(tiny: Path, out: Path, vocab: int) -> Path:
    """The tiny model folder with a byte-level BPE of ``vocab`` tokens trained on stdlib text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    base = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    specials = [t.content for t in base.get_added_tokens_decoder().values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    start = time.perf_counter()
    tok.train_from_iterator(stdlib_text(), trainer=trainer)
    tok.post_processor = base.post_processor
    tok.save(str(out / "tokenizer.json"))
    for name in ("tokenizer_config.json", "config.json"):
        (out / name).write_bytes((tiny / name).read_bytes())
    print(f"tokenizer: byte-level BPE, {tok.get_vocab_size():,} tokens, trained on stdlib "
          f"text in {time.perf_counter() - start:.0f} s")
    return out


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
    ap.add_argument("--vocab", type=int, default=0, help="train a BPE of this many tokens")
    ap.add_argument("--corpus", choices=("synthetic", "stdlib"), default="synthetic")
    ap.add_argument("--processes", type=int, default=None, help="worker processes (0: thread)")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tok-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not model.exists():
        make_tiny_model(model)
    if a.vocab:
        model = real_vocab_model(model, work / f"model-bpe{a.vocab}", a.vocab)
    tok = load_tokenizer(model)
    print(f"machine: {os.cpu_count()} cores; vocabulary {tok.tok.get_vocab_size():,} tokens")
    if a.processes is not None:
        forced = a.processes
        tokenize_mod.auto_processes = lambda total_bytes: forced
    data = work / f"corpus-{a.corpus}-{a.size_mb:g}.jsonl"
    start = time.perf_counter()
    write = write_stdlib_corpus if a.corpus == "stdlib" else write_corpus
    size = data.stat().st_size if data.is_file() else write(data, a.size_mb)
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
