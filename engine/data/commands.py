"""CLI: ``data inspect`` (format, counts, length histogram, samples with trained text marked)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import DataConfig
from engine.data.formats import FORMATS
from engine.events import Log, Progress

if TYPE_CHECKING:  # the handler imports them: --help stays free of torch
    from engine.data.prepare import DataStats
    from engine.data.preview import Sample

_GREEN, _RESET = "\033[32m", "\033[0m"


def register(sub) -> None:
    p = sub.add_parser("data", help="inspect a dataset: formats, token counts, masks")
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    q = dsub.add_parser("inspect", help="tokenize a dataset (cached) and show what is trained")
    d = DataConfig()
    q.add_argument("file", help=".jsonl, .json or .txt file, or a folder of .txt files")
    q.add_argument("--model", required=True, help="model folder (tokenizer and chat template)")
    q.add_argument("--format", default=d.format, choices=FORMATS)
    q.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    q.add_argument("--train-on", default=d.train_on, choices=("assistant", "all"))
    q.add_argument("--truncation", default=d.truncation, choices=("truncate", "drop", "error"))
    q.add_argument("--no-packing", action="store_true", help="one record per sequence, padded")
    q.add_argument("--samples", type=int, default=3, help="records to show")
    q.add_argument("--cache-dir", default=None, help="token cache (default: the user cache)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=_inspect)


def default_cache_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("slideformer")) / "data"


def _inspect(a) -> int:
    cfg = DataConfig(train=a.file, format=a.format, max_seq_len=a.max_seq_len,
                     train_on=a.train_on, truncation=a.truncation, packing=not a.no_packing)
    from engine.data.analysis import analyse_data

    found = analyse_data(cfg, a.model, Path(a.cache_dir) if a.cache_dir else default_cache_dir(),
                         a.samples, emit=_print_event)
    if a.json:
        print(json.dumps({"file": a.file, "stats": dataclasses.asdict(found.stats),
                          "samples": found.samples}, indent=2, ensure_ascii=False))
    else:
        print(report(a.file, found.stats, found.samples, color=sys.stdout.isatty()))
    return 0


def _print_event(ev) -> None:
    if isinstance(ev, Log) and ev.level != "info":
        print(f"{ev.level}: {ev.message}", file=sys.stderr)
    elif isinstance(ev, Progress) and ev.total and sys.stderr.isatty():
        end = "\n" if ev.done >= ev.total else ""
        print(f"\r{ev.task}: {100 * ev.done / ev.total:5.1f}%", end=end, file=sys.stderr)


def report(file: str, s: DataStats, samples: list[Sample], color: bool = False) -> str:
    """The human-readable ``data inspect`` text."""
    template = f" (chat template: {s.template})" if s.template else ""
    lines = [
        f"file        {file}",
        f"format      {s.format}{template}",
        f"records     {s.records:,} (train {s.train_records:,}, validation {s.val_records:,})",
        f"tokens      {s.tokens:,} in training sequences, {s.trained_tokens:,} trained",
        f"sequences   {s.train_sequences:,} x {s.seq_len} tokens, "
        f"{'packed' if s.packing else 'padded'}, {100 * s.fill:.1f}% filled",
        f"truncated   {s.truncated:,}   dropped {s.dropped:,}   nothing to train {s.no_target:,}",
        "record lengths (tokens, before truncation)",
    ]
    top = max(s.hist_counts, default=0) or 1
    used = [i for i, n in enumerate(s.hist_counts) if n]
    for i in range(used[0], used[-1] + 1) if used else ():
        lo, hi, n = s.hist_edges[i], s.hist_edges[i + 1] - 1, s.hist_counts[i]
        lines.append(f"  {lo:>7}-{hi:<7} {'#' * round(40 * n / top):<40} {n:,}")
    legend = "green" if color else "[[...]]"
    for i, sample in enumerate(samples, 1):
        lines.append(f"--- sample {i} (trained text in {legend}) ---")
        lines.append("".join(_mark(piece, trained, color) for piece, trained in sample))
    return "\n".join(lines)


def _mark(piece: str, trained: bool, color: bool) -> str:
    if not trained:
        return piece
    return f"{_GREEN}{piece}{_RESET}" if color else f"[[{piece}]]"
