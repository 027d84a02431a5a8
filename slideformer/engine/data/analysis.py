"""What a data set looks like to a model: the figures of ``data inspect`` and the Data page."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from slideformer.engine.config import DataConfig
from slideformer.engine.data.prepare import DataStats, prepare_data
from slideformer.engine.data.preview import Preview, preview
from slideformer.engine.models.tokenizer import load_tokenizer


@dataclass(frozen=True)
class DataAnalysis:
    """What ``data inspect`` and the Data page show about a data set."""

    stats: DataStats
    """Format, record and token counts, the length histogram."""
    preview: Preview
    """The first records as the model sees them (and the template's warnings)."""


def analyse_data(cfg: DataConfig, model_path: Path | str, cache_dir: Path | str,
                 samples: int = 3, emit: Callable | None = None,
                 on_preview: Callable[[Preview], None] | None = None) -> DataAnalysis:
    """Preview ``cfg``'s first ``samples`` records, then tokenize the whole data set with the
    model's tokenizer (cached under ``cache_dir``, the cache a run reads).

    The preview comes first: it reads only the head of the data, so a bad record is reported
    (and the records shown, through ``on_preview``) before the long preparation starts.

    Args:
        emit: receives the Progress and Log events of the preparation.
        on_preview: receives the preview as soon as it exists.
    """
    tok = load_tokenizer(model_path)
    shown = preview(cfg, tok, samples)
    if on_preview is not None:
        on_preview(shown)
    prepared = prepare_data(cfg, tok, Path(cache_dir), emit=emit)
    return DataAnalysis(prepared.stats, shown)
