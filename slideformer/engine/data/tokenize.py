"""Streaming tokenization of a data source into a token store, with progress events.

Records are read, validated and converted in batches (``BATCH_RECORDS`` records or
``BATCH_BYTES`` of input, whichever comes first) on the calling thread, and each batch is encoded
by an :class:`~slideformer.engine.data.workers.Encoder` while the next ones are read. Batches are written in
order; memory stays bounded by the encoder's depth, whatever the file size.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from slideformer.engine.config import DataConfig
from slideformer.engine.data import formats
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.records import Record, RecordReader
from slideformer.engine.data.store import StoreWriter
from slideformer.engine.data.workers import Encoder, auto_processes
from slideformer.engine.events import Progress
from slideformer.engine.models.tokenizer import TokenizerInfo

BATCH_RECORDS = 4096
BATCH_BYTES = 4 << 20


class FormatTracker:
    """The format of each file: forced by the config, or detected from its first record."""

    def __init__(self, cfg: DataConfig, renderer: ChatRenderer):
        self.forced = cfg.format
        self.schema = formats.Schema.of(cfg)
        self.renderer = renderer
        self.per_file: dict[Path, tuple[str, str]] = {}

    def document(self, rec: Record) -> formats.Document:
        """Validate and convert one record (a :class:`UserError` names its line)."""
        if rec.file not in self.per_file:
            if self.forced != "auto":
                self.per_file[rec.file] = (self.forced, "set by data.format")
            else:
                self.per_file[rec.file] = (formats.detect(rec, self.schema),
                                           f"detected from line {rec.line}")
        fmt, origin = self.per_file[rec.file]
        doc = formats.to_document(rec, fmt, origin, self.schema)
        if not isinstance(doc, str):
            self.renderer.check(doc, rec.where)
        return doc

    @property
    def name(self) -> str:
        """The format of the source (its files share one: a folder holds only .txt)."""
        return next(iter(self.per_file.values()))[0] if self.per_file else self.forced


def build_store(files: list[Path], cfg: DataConfig, tok: TokenizerInfo, renderer: ChatRenderer,
                folder: Path, emit: Callable | None, task: str,
                processes: int | None = None) -> dict:
    """Tokenize ``files`` into the store folder ``folder``; returns its meta.json content.

    Args:
        cfg: the data settings (format, field names, train_on, max_samples).
        renderer: the chat template conversations are rendered with.
        processes: worker processes; None chooses (see :mod:`slideformer.engine.data.workers`), 0 uses
            one helper thread.
    """
    reader = RecordReader(files, limit=cfg.max_samples)
    tracker = FormatTracker(cfg, renderer)
    index = {f: i for i, f in enumerate(files)}
    counts = {"records": 0, "empty": 0}
    emit = emit or (lambda ev: None)
    emit(Progress(task, 0, reader.total_bytes))
    if processes is None:
        processes = auto_processes(reader.total_bytes)
    with StoreWriter(folder) as writer, Encoder(tok, renderer, cfg.train_on,
                                                processes) as encoder:
        pending: deque = deque()
        for batch in _batches(reader):
            docs, origin = _documents(batch, tracker, index, counts)
            pending.append((encoder.start(docs), origin))
            while len(pending) > encoder.depth:
                _write(writer, *pending.popleft())
            emit(Progress(task, reader.bytes_done, reader.total_bytes))
        while pending:
            _write(writer, *pending.popleft())
    return {"format": tracker.name, "files": [str(f) for f in files],
            "records": counts["records"], "empty": counts["empty"],
            "builtin_template": tracker.name in formats.CHAT_FORMATS and renderer.builtin}


def _write(writer: StoreWriter, handle, origin: np.ndarray) -> None:
    enc = handle.wait()
    writer.append(enc.ids, enc.mask, enc.lengths, origin)


def _batches(reader: RecordReader) -> Iterator[list[Record]]:
    batch, start = [], reader.bytes_done
    for rec in reader:
        batch.append(rec)
        if len(batch) >= BATCH_RECORDS or reader.bytes_done - start >= BATCH_BYTES:
            yield batch
            batch, start = [], reader.bytes_done
    if batch:
        yield batch


def _documents(batch: list[Record], tracker: FormatTracker, index: dict,
               counts: dict) -> tuple[list, np.ndarray]:
    """Convert records to documents, skipping (and counting) empty ones."""
    docs, origin = [], []
    for rec in batch:
        doc = tracker.document(rec)
        counts["records"] += 1
        if formats.is_empty(doc):
            counts["empty"] += 1
            continue
        docs.append(doc)
        origin.append((index[rec.file], rec.line))
    return docs, np.asarray(origin, dtype=np.int32).reshape(-1, 2)
