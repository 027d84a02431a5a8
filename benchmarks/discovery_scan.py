"""Speed of model discovery (``slideformer models``, the Model page's "On this machine") on a
large synthetic machine.

Builds a hub cache of ``--hf`` models and ``--gguf`` GGUF files (half Ollama tags, half LM
Studio files) in a temporary folder: real models' configs (tools/synthetic_stores.CONFIGS),
each one a little different (its vocabulary, its depth) so no two plan alike, weights as sparse
files, GGUF files with their full header (vocabulary and merges included). Then times
:func:`discover_models` on it: the first scan of the process (every GGUF header read), and the
median of ``--repeats`` rescans (headers cached while the files are unchanged), split into
listing the stores, reading the configs and headers, and planning.

    python benchmarks/discovery_scan.py [--hf 200] [--gguf 50] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/, when run as a script

from slideformer.engine.models import discover  # noqa: E402
from slideformer.engine.models.stores import Roots, candidates  # noqa: E402
from tools.synthetic_stores import (CONFIGS, gguf_header_file, hub_entry,  # noqa: E402
                                    ollama_entry, weights_bytes)


def variant(i: int) -> tuple[str, dict]:
    """The i-th model: a real config with a vocabulary and a depth of its own."""
    name = list(CONFIGS)[i % len(CONFIGS)]
    cfg = dict(CONFIGS[name], vocab_size=CONFIGS[name]["vocab_size"] + 64 * i,
               num_hidden_layers=CONFIGS[name]["num_hidden_layers"] + i % 5)
    return f"{name}-v{i}", cfg


def build(root: Path, n_hf: int, n_gguf: int) -> Roots:
    roots = Roots(root / "hub", (root / "ollama",), (root / "lmstudio",))
    for i in range(n_hf):
        name, cfg = variant(i)
        hub_entry(roots.hf_cache, f"org/{name}", {"config.json": json.dumps(cfg).encode(),
                                                  "model.safetensors": weights_bytes(cfg)})
    for i in range(n_gguf):
        name, cfg = variant(n_hf + i)
        if i % 2:
            gguf_header_file(roots.lm_studio[0] / "pub" / f"{name}-GGUF" / f"{name}-Q4_0.gguf",
                             cfg, "q4_0", name)
        else:
            ollama_entry(roots.ollama[0], f"{name.lower()}:q4",
                         gguf_header_file(root / "tmp.gguf", cfg, "q4_0", name))
    return roots


def scan(roots: Roots, cold: bool) -> dict[str, float]:
    """Seconds of one scan, and of its parts: listing the stores, reading each find (again,
    from the same cache state) and planning (the rest). ``cold``: no GGUF header cached."""
    def timed(fn):
        if cold:
            discover._gguf_facts.cache_clear()
        start = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - start

    rows, total = timed(lambda: discover.discover_models(roots=roots))
    found, listing = timed(lambda: candidates(roots))
    facts, reading = timed(lambda: [discover._facts(c) for c in found])
    assert len(rows) == len(found) == len(facts)
    return {"list": listing, "read": reading, "plan": total - listing - reading, "total": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", type=int, default=200)
    ap.add_argument("--gguf", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="discovery-bench-") as tmp:
        t = time.perf_counter()
        roots = build(Path(tmp), a.hf, a.gguf)
        print(f"built {a.hf} hub models and {a.gguf} GGUF files in {time.perf_counter() - t:.1f} s")
        n = a.hf + a.gguf
        discover.discover_models(roots=Roots(Path(tmp) / "none", (), ()))  # imports, machine
        runs = [scan(roots, cold=i == 0) for i in range(1 + a.repeats)]
        first, again = runs[0], {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
        print(f"{'':<28} {'total':>8} {'models/s':>9} {'list':>8} {'read':>8} {'plan':>8}")
        for label, r in ((f"first scan ({n} models)", first),
                         (f"rescan, median of {a.repeats}", again)):
            print(f"{label:<28} {r['total']:>7.2f}s {n / r['total']:>9.0f} {r['list']:>7.2f}s "
                  f"{r['read']:>7.2f}s {r['plan']:>7.2f}s")


if __name__ == "__main__":
    main()
