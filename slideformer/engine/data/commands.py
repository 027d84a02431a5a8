"""CLI: ``data inspect`` (format, counts, length histogram, samples with trained text marked)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from slideformer.engine.config import DataConfig
from slideformer.engine.data.formats import FORMATS
from slideformer.engine.events import Log, Progress

if TYPE_CHECKING:  # the handler imports them: --help stays free of torch
    from slideformer.engine.data.prepare import DataStats
    from slideformer.engine.data.preview import Preview, Sample

_GREEN, _RESET = "\033[32m", "\033[0m"


def register(sub) -> None:
    p = sub.add_parser("data", help="inspect a dataset: formats, token counts, masks")
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    q = dsub.add_parser("inspect", help="tokenize a dataset (cached) and show what is trained")
    d = DataConfig()
    q.add_argument("file", help=".jsonl, .json, .txt, .csv, .parquet or .arrow file, or a "
                   "folder of .txt files")
    q.add_argument("--model", required=True, help="model folder (tokenizer and chat template)")
    q.add_argument("--format", default=d.format, choices=FORMATS)
    q.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    q.add_argument("--train-on", default=d.train_on, choices=("assistant", "all"))
    q.add_argument("--truncation", default=d.truncation, choices=("truncate", "drop", "error"))
    q.add_argument("--mask-history", action="store_true", help="train the last reply only")
    q.add_argument("--max-samples", type=int, default=d.max_samples,
                   help="read at most this many records (0: all)")
    q.add_argument("--chat-template", default=d.chat_template,
                   help='"chatml" or a .jinja file instead of the model\'s template')
    q.add_argument("--no-thinking", action="store_true",
                   help="enable_thinking=false for the template (Qwen3: non-reasoning replies)")
    q.add_argument("--config", default=None, help="take the [data] section of this run .toml "
                   "(the options above are then ignored, except the file)")
    q.add_argument("--no-packing", action="store_true", help="one record per sequence, padded")
    q.add_argument("--samples", type=int, default=3, help="records to show")
    q.add_argument("--cache-dir", default=None, help="token cache (default: the user cache)")
    q.add_argument("--pairs", action="store_true",
                   help="read preference pairs (prompt, chosen, rejected) as train.objective = "
                        "dpo, orpo or simpo does, and show their responses")
    q.add_argument("--kto", action="store_true",
                   help="read labelled replies (prompt, completion, label) as train.objective = "
                        "kto does, and show their responses")
    q.add_argument("--prompts", action="store_true",
                   help="read prompts (with answers) as train.objective = grpo does, and show "
                        "what the model is asked")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=_inspect)


def default_cache_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("slideformer")) / "data"


def _config(a) -> DataConfig:
    if a.config:
        from slideformer.engine.config import load
        return dataclasses.replace(load(a.config).data, train=a.file)
    return DataConfig(train=a.file, format=a.format, max_seq_len=a.max_seq_len,
                      train_on=a.train_on, truncation=a.truncation, packing=not a.no_packing,
                      mask_history=a.mask_history, max_samples=a.max_samples,
                      chat_template=a.chat_template, enable_thinking=not a.no_thinking)


def _inspect(a) -> int:
    from slideformer.engine.data.analysis import analyse_data
    if a.pairs or a.kto:
        return _inspect_pairs(a)
    if a.prompts:
        return _inspect_prompts(a)

    def warn(shown) -> None:  # the preview comes first: a bad record stops here, in a second
        for w in shown.warnings:
            print(f"warning: {w}", file=sys.stderr)

    found = analyse_data(_config(a), a.model,
                         Path(a.cache_dir) if a.cache_dir else default_cache_dir(), a.samples,
                         emit=_print_event, on_preview=warn)
    if a.json:
        print(json.dumps({"file": a.file, "stats": dataclasses.asdict(found.stats),
                          "samples": [dataclasses.asdict(s) for s in found.preview.samples],
                          "warnings": found.preview.warnings}, indent=2, ensure_ascii=False))
    else:
        print(report(a.file, found.stats, found.preview, color=sys.stdout.isatty()))
    return 0


def _inspect_pairs(a) -> int:
    from slideformer.engine.data.preference import describe_pairs
    from slideformer.engine.models.tokenizer import load_tokenizer
    found = describe_pairs(_config(a), load_tokenizer(a.model), a.samples, kto=a.kto)
    if a.json:
        print(json.dumps({"file": a.file, **dataclasses.asdict(found)}, indent=2,
                         ensure_ascii=False))
        return 0
    color = sys.stdout.isatty()
    template = f" (chat template: {found.template})" if found.template else " (plain strings)"
    if a.kto:
        lines = [f"file        {a.file}", f"replies     {found.pairs:,}{template}: "
                 f"{found.desirable:,} desirable, {found.pairs - found.desirable:,} undesirable",
                 f"tokens      prompt {found.prompt_tokens:.1f}, desirable reply "
                 f"{found.chosen_tokens:.1f}, undesirable reply {found.rejected_tokens:.1f} "
                 "(means; the replies' tokens count)",
                 f"truncated   {found.truncated:,} replies cut at {a.max_seq_len} tokens"]
    else:
        lines = [f"file        {a.file}", f"pairs       {found.pairs:,}{template}",
                 f"tokens      prompt {found.prompt_tokens:.1f}, chosen reply "
                 f"{found.chosen_tokens:.1f}, rejected reply {found.rejected_tokens:.1f} "
                 "(means; the replies' tokens count)",
                 f"truncated   {found.truncated:,} pairs cut at {a.max_seq_len} tokens"]
    legend = "green" if color else "[[...]]"
    for where, side, pieces in found.samples:
        lines.append(f"--- {where}, {side} (the response, whose log-probability counts, in "
                     f"{legend}) ---")
        lines.append("".join(_mark(piece, resp, color) for piece, resp in pieces))
    print("\n".join(lines))
    return 0


def _inspect_prompts(a) -> int:
    """GRPO's prompt file: what each prompt renders to (the model continues from it), its
    length and its answer."""
    from slideformer.engine.data.chat import ChatRenderer
    from slideformer.engine.models.tokenizer import load_tokenizer
    from slideformer.engine.train.grpo import read_prompts
    tok = load_tokenizer(a.model)
    cfg = _config(a)
    prompts = read_prompts(cfg, tok, ChatRenderer(tok, cfg.chat_template, cfg.enable_thinking))
    lengths = [len(p.ids) for p in prompts]
    answered = sum(p.answer is not None for p in prompts)
    shown = [{"where": p.where, "prompt": p.text, "tokens": len(p.ids), "answer": p.answer}
             for p in prompts[:a.samples]]
    if a.json:
        print(json.dumps({"file": a.file, "prompts": len(prompts), "with_answer": answered,
                          "prompt_tokens_mean": sum(lengths) / len(lengths),
                          "prompt_tokens_max": max(lengths), "samples": shown},
                         indent=2, ensure_ascii=False))
        return 0
    lines = [f"file        {a.file}",
             f"prompts     {len(prompts):,} ({answered:,} with an answer for the answer check)",
             f"tokens      prompt {sum(lengths) / len(lengths):.1f} mean, {max(lengths):,} "
             f"longest; replies get the rest of {a.max_seq_len:,} (grpo.max_new_tokens at most)"]
    for s in shown:
        lines.append(f"--- {s['where']}, {s['tokens']} tokens; answer {s['answer']!r} ---")
        lines.append(s["prompt"])
    print("\n".join(lines))
    return 0


def _print_event(ev) -> None:
    if isinstance(ev, Log) and ev.level != "info":
        print(f"{ev.level}: {ev.message}", file=sys.stderr)
    elif isinstance(ev, Progress) and ev.total and sys.stderr.isatty():
        end = "\n" if ev.done >= ev.total else ""
        print(f"\r{ev.task}: {100 * ev.done / ev.total:5.1f}%", end=end, file=sys.stderr)


def report(file: str, s: DataStats, shown: Preview, color: bool = False) -> str:
    """The human-readable ``data inspect`` text."""
    template = f" (chat template: {s.template})" if s.template else ""
    lines = [
        f"file        {file}",
        f"format      {s.format}{template}",
        f"records     {s.records:,} (train {s.train_records:,}, validation {s.val_records:,})",
        f"tokens      {s.tokens:,} in training sequences, {s.trained_tokens:,} trained, "
        f"{s.dropped_tokens:,} dropped (in no sequence)",
        f"sequences   {s.train_sequences:,} x {s.seq_len} tokens, "
        f"{'packed' if s.packing else 'padded'}, {100 * s.fill:.1f}% filled",
        f"truncated   {s.truncated:,}   dropped {s.dropped:,}   nothing to train {s.no_target:,}"
        f"   cut into blocks {s.split:,}",
        "record lengths (tokens, before truncation)",
    ]
    top = max(s.hist_counts, default=0) or 1
    used = [i for i, n in enumerate(s.hist_counts) if n]
    for i in range(used[0], used[-1] + 1) if used else ():
        lo, hi, n = s.hist_edges[i], s.hist_edges[i + 1] - 1, s.hist_counts[i]
        lines.append(f"  {lo:>7}-{hi:<7} {'#' * round(40 * n / top):<40} {n:,}")
    legend = "green" if color else "[[...]]"
    for i, sample in enumerate(shown.samples, 1):
        lines.append(f"--- sample {i}, {sample.where}: {sample_counts(sample)} "
                     f"(trained text in {legend}) ---")
        lines.append("".join(_mark(piece, trained, color) for piece, trained in sample.pieces))
    return "\n".join(lines)


def sample_counts(s: Sample) -> str:
    """"812 tokens, 240 trained, 0 dropped" (and the blocks of a long text)."""
    if s.partial:
        return (f"a long text, more than {s.tokens:,} tokens in more than {s.blocks} blocks "
                "(the totals are in the summary), 0 dropped")
    blocks = f" in {s.blocks} blocks" if s.blocks > 1 else ""
    return f"{s.tokens:,} tokens{blocks}, {s.trained:,} trained, {s.dropped:,} dropped"


def _mark(piece: str, trained: bool, color: bool) -> str:
    if not trained:
        return piece
    return f"{_GREEN}{piece}{_RESET}" if color else f"[[{piece}]]"
