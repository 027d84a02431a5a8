"""What the engine makes of a dataset, for the Data page: its figures and the first records as
the model sees them (:func:`analyse`, run on a worker thread), and the HTML of that preview.

A file of preference pairs or of GRPO's prompts (:func:`slideformer.engine.api.records_kind`,
from its first record) is shown as ``data inspect --pairs`` / ``--prompts`` shows it: a
:class:`PairsReport` or :class:`PromptsReport` in place of the SFT :class:`DataReport`.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from slideformer.engine.api import (DataConfig, DataStats, Log, PairReport, Preview, Progress,
                                    PromptReport, analyse_data, describe_pairs, describe_prompts,
                                    records_kind, sample_counts, write_task)
from slideformer.gui.models.formatting import human_count

SAMPLES = 4
"""Records shown in the preview."""
DEMO_RECORDS = 4000
MASKED_COLOR = "#9ca3af"
"""Text of the tokens without a loss (prompt, template)."""
MASKED_STYLE = f"color:{MASKED_COLOR};"
TRAINED_STYLE = "background-color:#dcfce7; color:#065f46;"
"""Tokens with a loss (SFT), or a pair's response (whose log-probability counts)."""
ANSWER_STYLE = "background-color:#dbeafe; color:#1e3a8a;"
"""A GRPO prompt's answer: compared with the sampled reply, never trained on."""
LINE_BREAK = "&nbsp;&nbsp;⏎ line break"
VIEWS = {
    "sft": ("What the model sees: the first records, templated",
            (f'<span style="{TRAINED_STYLE}">&nbsp;trained (has a loss)&nbsp;</span>&nbsp;&nbsp;'
             f'<span style="{MASKED_STYLE}">masked (prompt, template)</span>{LINE_BREAK}')),
    "pairs": ("What the model sees: the first pairs, chosen and rejected",
              (f'<span style="{TRAINED_STYLE}">&nbsp;response (its log-probability counts)'
               f'&nbsp;</span>&nbsp;&nbsp;<span style="{MASKED_STYLE}">prompt, template</span>'
               f'{LINE_BREAK}')),
    "kto": ("What the model sees: the first labelled replies",
            (f'<span style="{TRAINED_STYLE}">&nbsp;response (its log-probability counts)'
             f'&nbsp;</span>&nbsp;&nbsp;<span style="{MASKED_STYLE}">prompt, template</span>'
             f'{LINE_BREAK}')),
    "prompts": ("What the model is asked: the first prompts, templated",
                (f'the prompt (the reply is sampled after it)&nbsp;&nbsp;<span '
                 f'style="{ANSWER_STYLE}">&nbsp;answer&nbsp;</span>&nbsp;what the answer check '
                 f'compares the reply with{LINE_BREAK}')),
}
"""The preview's title and legend for each kind of file."""
DETECTED = {"pairs": "detected: preference pairs (prompt, chosen, rejected) for DPO, ORPO or "
                     "SimPO",
            "kto": "detected: labelled replies (prompt, completion, label) for KTO",
            "prompts": "detected: prompts with answers for GRPO"}
"""What the settings line says a file of pairs or prompts is."""
SUMMARY_ROWS = {
    "sft": ("Records", "Validation", "Tokens", "Trained tokens", "Sequences", "Truncated",
            "Left out"),
    "pairs": ("Pairs", "Prompt", "Chosen reply", "Rejected reply", "Truncated"),
    "kto": ("Replies", "Prompt", "Desirable reply", "Undesirable reply", "Truncated"),
    "prompts": ("Prompts", "With answers", "Prompt", "Replies"),
}
"""The Summary's rows for each kind of file (:func:`slideformer.engine.api.records_kind`)."""


@dataclass(frozen=True)
class DataReport:
    """The engine's answer for one set of data settings."""

    cfg: DataConfig
    stats: DataStats
    preview: Preview
    """The first records as the model sees them."""
    warnings: list[str]
    """The engine's warnings (preview and preparation)."""


@dataclass(frozen=True)
class PairsReport:
    """Preference pairs (train.objective dpo, orpo, simpo) as the engine reads them."""

    cfg: DataConfig
    found: PairReport


@dataclass(frozen=True)
class PromptsReport:
    """GRPO's prompts as the engine reads them."""

    cfg: DataConfig
    found: PromptReport


class AnalysisProgress(QObject):
    """Carries the engine's Progress events and the early preview from the worker thread."""

    changed = Signal(str, int, int)
    read_as = Signal(object, str)
    """(DataConfig, "sft", "pairs" or "prompts"): how the file is read, before it is."""
    previewed = Signal(object, object)
    """(DataConfig, the first records before the whole file is read): an SFT Preview, or a
    PairsReport / PromptsReport of the first records only."""


def analyse(cfg: DataConfig, model_path: str, cache_dir: Path,
            progress: AnalysisProgress) -> DataReport | PairsReport | PromptsReport:
    """Preview the first records of ``cfg`` (sent on at once), then read the whole file: SFT
    data prepared (cached), or pairs or prompts described."""
    kind = records_kind(cfg)
    progress.read_as.emit(cfg, kind)
    if kind != "sft":
        describe, report = {"pairs": (describe_pairs, PairsReport),
                            "kto": (partial(describe_pairs, kto=True), PairsReport),
                            "prompts": (describe_prompts, PromptsReport)}[kind]
        head = replace(cfg, max_samples=min(cfg.max_samples or SAMPLES, SAMPLES))
        progress.previewed.emit(cfg, report(cfg, describe(head, model_path, SAMPLES)))
        return report(cfg, describe(cfg, model_path, SAMPLES))
    warnings: list[str] = []

    def emit(ev) -> None:
        if isinstance(ev, Progress):
            progress.changed.emit(ev.task, ev.done, ev.total or 0)
        elif isinstance(ev, Log) and ev.level != "info":
            warnings.append(ev.message)

    found = analyse_data(cfg, model_path, cache_dir, SAMPLES, emit,
                         on_preview=lambda shown: progress.previewed.emit(cfg, shown))
    return DataReport(cfg, found.stats, found.preview, list(found.preview.warnings) + warnings)


def make_demo_dataset(path: Path) -> str:
    """The letter-reversal chat dataset of ``slideformer demo`` (kept when it exists)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_task(path, DEMO_RECORDS, seed=1)
    return str(path)


def sft_summary(s: DataStats) -> dict[str, str]:
    """The Summary rows of SFT data (row name: value)."""
    cut = f"; {s.split:,} texts cut into blocks" if s.split else ""
    return dict(zip(SUMMARY_ROWS["sft"], (
        f"{s.records:,} read, {s.train_records:,} for training",
        f"{s.val_records:,} records" if s.val_records else "none",
        f"{s.tokens:,}  ({human_count(s.tokens)})",
        (f"{s.trained_tokens:,}  ({s.trained_tokens / max(1, s.tokens):.0%} of tokens); "
         f"{s.dropped_tokens:,} dropped (in no sequence)"),
        (f"{s.train_sequences:,} × {s.seq_len} tokens, {'packed' if s.packing else 'padded'}, "
         f"{s.fill:.0%} filled"),
        f"{s.truncated:,} records longer than {s.seq_len}{cut}",
        f"{s.dropped:,} too long, {s.no_target:,} with nothing to train")))


def pairs_summary(found: PairReport, seq_len: int) -> dict[str, str]:
    """The Summary rows of preference pairs or KTO's labelled replies (``data inspect
    --pairs`` / ``--kto``'s counts)."""
    kto = found.desirable is not None
    n = ((f"{found.pairs:,}: {found.desirable:,} desirable, "
          f"{found.pairs - found.desirable:,} undesirable") if kto else f"{found.pairs:,}")
    return dict(zip(SUMMARY_ROWS["kto" if kto else "pairs"], (
        n,
        f"{found.prompt_tokens:,.1f} tokens on average",
        f"{found.chosen_tokens:,.1f} tokens on average",
        f"{found.rejected_tokens:,.1f} tokens on average",
        f"{found.truncated:,} {'replies' if kto else 'pairs with a reply'} cut at "
        f"{seq_len:,} tokens")))


def prompts_summary(found: PromptReport, seq_len: int) -> dict[str, str]:
    """The Summary rows of GRPO's prompts (``data inspect --prompts``'s counts)."""
    return dict(zip(SUMMARY_ROWS["prompts"], (
        f"{found.prompts:,}",
        f"{found.with_answer:,} (for the answer check)",
        f"{found.mean_tokens:,.1f} tokens on average, {found.max_tokens:,} the longest",
        f"sampled into the rest of {seq_len:,} tokens (grpo.max_new_tokens at most)")))


def kind_line(kind: str, detail: str = "") -> str:
    """The settings line of pairs or prompts ("" for SFT data: its format, once detected)."""
    return DETECTED[kind] + detail if kind != "sft" else ""


def sample_html(shown: Preview) -> str:
    """The preview as HTML: trained pieces on green, masked ones grey."""
    return "".join(_block(f"record {i} ({_name(s.where)}): {sample_counts(s)}", _spans(s.pieces))
                   for i, s in enumerate(shown.samples, 1))


def pairs_html(found: PairReport) -> str:
    """The first pairs, chosen then rejected: the responses on green, as trained text is."""
    blocks, first = [], {}
    what = "pair" if found.desirable is None else "reply"
    for where, side, pieces in found.samples:
        k = first.setdefault(where, len(first) + 1)
        title = (f"pair {k} ({_name(where)}): the {side} reply" if what == "pair" else
                 f"reply {k} ({_name(where)}): {side}")
        blocks.append(_block(title, _spans(pieces)))
    return "".join(blocks)


def prompts_html(found: PromptReport) -> str:
    """The first prompts as the model reads them (its reply is sampled after), each with its
    answer."""
    blocks = []
    for i, p in enumerate(found.samples, 1):
        answer = (f'<span style="{ANSWER_STYLE}">{_text(p.answer)}</span>' if p.answer is not None
                  else '<span style="color:#6b7280;">none (a reward file scores the reply)</span>')
        blocks.append(_block(f"prompt {i} ({_name(p.where)}): {len(p.ids):,} tokens",
                             _text(p.text), end=2)
                      + f'<p style="margin:0 0 12px 0;">answer: {answer}</p>')
    return "".join(blocks)


def _spans(pieces) -> str:
    """Text pieces ``(text, marked)``: marked ones on green, the others grey."""
    return "".join(f'<span style="{TRAINED_STYLE if marked else MASKED_STYLE}">'
                   f'{_text(piece)}</span>' for piece, marked in pieces)


def _block(title: str, body: str, end: int = 12) -> str:
    """A small title line over ``body`` (HTML) in monospace, ``end`` px of space after."""
    return (f'<p style="margin:0 0 2px 0; color:#6b7280; font-size:8pt;">{html.escape(title)}'
            f'</p><p style="font-family:monospace; margin:0 0 {end}px 0;">{body}</p>')


def _text(piece: str) -> str:
    return html.escape(piece).replace("\n", "⏎<br>")


def _name(where: str) -> str:
    """"data.jsonl:3" of "/home/me/data.jsonl:3"."""
    return Path(where).name


def dropped_file(urls) -> str | None:
    if len(urls) != 1 or not urls[0].isLocalFile():
        return None
    p = Path(urls[0].toLocalFile())
    return str(p) if p.exists() else None
