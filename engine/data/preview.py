"""Previews for the GUI and ``data inspect``: the first records as trained / masked text."""
from __future__ import annotations

from itertools import islice

from engine.config import DataConfig
from engine.data import formats
from engine.data.chat import ChatRenderer
from engine.data.encode import encode_documents, segments
from engine.data.prepare import check_config
from engine.data.records import RecordReader, source_files
from engine.data.tokenize import FormatTracker
from engine.models.tokenizer import TokenizerInfo

Sample = list[tuple[str, bool]]
"""A record as (text piece, trained) runs; the pieces join into the exact model input."""


def preview(cfg: DataConfig, tok: TokenizerInfo, n: int = 5) -> list[Sample]:
    """The first ``n`` non-blank training records, rendered and tokenized like for training.

    No cache is read or written, so this is instant on any file size. Truncation is not
    applied: tokens past ``max_seq_len`` show as they would be without it.
    """
    check_config(cfg)
    tracker = FormatTracker(cfg.format)
    docs = (tracker.document(r) for r in RecordReader(source_files(cfg.train)))
    chosen = list(islice((d for d in docs if not formats.is_empty(d)), n))
    batch = encode_documents(tok, ChatRenderer(tok), chosen, cfg.train_on, detail=True)
    return [segments(tok, batch, i) for i in range(len(chosen))]
