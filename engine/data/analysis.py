"""What a data set looks like to a model: the figures of ``data inspect`` and the Data page."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.config import DataConfig
from engine.data.prepare import DataStats, prepare_data
from engine.data.preview import preview
from engine.models.tokenizer import load_tokenizer


@dataclass(frozen=True)
class DataAnalysis:
    """What ``data inspect`` and the Data page show about a data set."""

    stats: DataStats
    """Format, record and token counts, the length histogram."""
    samples: list
    """The first records as ``[(text, trained), ...]`` pieces."""


def analyse_data(cfg: DataConfig, model_path: Path | str, cache_dir: Path | str,
                 samples: int = 3, emit: Callable | None = None) -> DataAnalysis:
    """Tokenize ``cfg``'s data set with the model's tokenizer (cached under ``cache_dir``, the
    cache a run reads) and preview its first ``samples`` records.

    Args:
        emit: receives the Progress and Log events of the preparation.
    """
    tok = load_tokenizer(model_path)
    prepared = prepare_data(cfg, tok, Path(cache_dir), emit=emit)
    return DataAnalysis(prepared.stats, preview(cfg, tok, samples))
