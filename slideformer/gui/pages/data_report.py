"""What the engine makes of a dataset, for the Data page: its figures and the first records as
the model sees them (:func:`analyse`, run on a worker thread), and the HTML of that preview.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from slideformer.engine.api import (DataConfig, DataStats, Log, Preview, Progress, analyse_data,
                                    sample_counts, write_task)

SAMPLES = 4
"""Records shown in the preview."""
DEMO_RECORDS = 4000
MASKED_COLOR = "#9ca3af"
"""Text of the tokens without a loss (prompt, template)."""


@dataclass(frozen=True)
class DataReport:
    """The engine's answer for one set of data settings."""

    cfg: DataConfig
    stats: DataStats
    preview: Preview
    """The first records as the model sees them."""
    warnings: list[str]
    """The engine's warnings (preview and preparation)."""


class AnalysisProgress(QObject):
    """Carries the engine's Progress events and the early preview from the worker thread."""

    changed = Signal(str, int, int)
    previewed = Signal(object, object)
    """(DataConfig, Preview): the first records, before the whole file is tokenised."""


def analyse(cfg: DataConfig, model_path: str, cache_dir: Path, progress: AnalysisProgress) -> DataReport:
    """Preview the first records of ``cfg`` (sent on at once), then prepare it (cached)."""
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


def sample_html(shown: Preview) -> str:
    """The preview as HTML: trained pieces on green, masked ones grey."""
    parts = []
    for i, sample in enumerate(shown.samples, 1):
        spans = []
        for piece, trained in sample.pieces:
            text = html.escape(piece).replace("\n", "⏎<br>")
            style = ("background-color:#dcfce7; color:#065f46;" if trained else
                     f"color:{MASKED_COLOR};")
            spans.append(f'<span style="{style}">{text}</span>')
        where = html.escape(Path(sample.where).name)
        parts.append(f'<p style="margin:0 0 2px 0; color:#6b7280; font-size:8pt;">record {i} '
                     f'({where}): {sample_counts(sample)}</p>'
                     f'<p style="font-family:monospace; margin:0 0 12px 0;">{"".join(spans)}</p>')
    return "".join(parts)


def dropped_file(urls) -> str | None:
    if len(urls) != 1 or not urls[0].isLocalFile():
        return None
    p = Path(urls[0].toLocalFile())
    return str(p) if p.exists() else None
