"""Previews for the GUI and ``data inspect``: the first records as trained / masked text.

A preview reads only the first records of ``data.train``, so it is instant on any file size and
needs no cache. Each record says how its tokens fare in training: how many carry a loss, how many
are lost to ``max_seq_len`` (conversations are truncated or dropped; plain text is cut into
blocks and loses nothing). The text shown stops after ``max_seq_len`` tokens, the length of one
training sequence.

A plain-text record longer than ``HEAD_CHARS_PER_TOKEN * max_seq_len`` characters (a book without
blank lines) is tokenized only that far: enough for the first sequence, whose tokens do not
depend on text that far after them, while tokenizing a whole 600 kB paragraph takes seconds
(4 s with the 384-token test vocabulary on one core). Its sample is then ``partial``: the token
counts are those of the head, and the totals come from ``prepare_data``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from slideformer.engine.config import DataConfig
from slideformer.engine.data import formats
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.encode import encode_documents, segments
from slideformer.engine.data.prepare import check_config
from slideformer.engine.data.records import RecordReader, source_files
from slideformer.engine.data.tokenize import FormatTracker
from slideformer.engine.models.tokenizer import TokenizerInfo

HEAD_CHARS_PER_TOKEN = 16
"""Characters read per shown token of a long text (real vocabularies average about 4)."""


@dataclass(frozen=True)
class Sample:
    """One record as the model sees it."""

    pieces: list
    """(text piece, trained) runs of its first max_seq_len tokens; they join into the exact
    model input."""
    where: str
    """file:line of the record."""
    tokens: int
    """Tokens of the whole record."""
    trained: int
    """Tokens with a loss target that make it into training sequences."""
    dropped: int
    """Tokens lost to max_seq_len (cut off, or the whole record left out)."""
    blocks: int
    """Training sequences the record fills: 1, or more where plain text is cut into blocks."""
    partial: bool = False
    """Only the head of a long text was tokenized: the counts are the head's."""


@dataclass(frozen=True)
class Preview:
    samples: list[Sample]
    format: str
    """The format of the first file (detected or forced)."""
    warnings: list[str] = field(default_factory=list)
    """Things that train differently from what the records say (e.g. a dropped system prompt)."""


def preview(cfg: DataConfig, tok: TokenizerInfo, n: int = 5) -> Preview:
    """The first ``n`` non-blank training records, rendered and tokenized like for training."""
    check_config(cfg)
    renderer = ChatRenderer(tok, cfg.chat_template, cfg.enable_thinking)
    tracker = FormatTracker(cfg, renderer)
    pairs = ((rec, tracker.document(rec)) for rec in RecordReader(source_files(cfg.train)))
    chosen = list(islice(((r, d) for r, d in pairs if not formats.is_empty(d)), n))
    head = HEAD_CHARS_PER_TOKEN * cfg.max_seq_len
    cut = [isinstance(d, str) and len(d) > head for _, d in chosen]
    docs = [d[:head] if c else d for (_, d), c in zip(chosen, cut)]
    batch = encode_documents(tok, renderer, docs, cfg.train_on, detail=True)
    if any(int(n) <= cfg.max_seq_len + 1 for n, c in zip(batch.lengths, cut) if c):
        # tokens longer than HEAD_CHARS_PER_TOKEN on average: read the records whole
        cut = [False] * len(chosen)
        batch = encode_documents(tok, renderer, [d for _, d in chosen], cfg.train_on,
                                 detail=True)
    samples, start = [], 0
    for i, (rec, doc) in enumerate(chosen):
        size = int(batch.lengths[i])
        mask = batch.mask[start:start + size]
        start += size
        samples.append(_sample(tok, batch, i, rec.where, mask, isinstance(doc, str), cfg,
                               cut[i]))
    return Preview(samples, tracker.name, _warnings(renderer, chosen))


def _sample(tok, batch, i: int, where: str, mask, text: bool, cfg: DataConfig,
            partial: bool) -> Sample:
    size, limit = len(mask), cfg.max_seq_len
    pieces = segments(tok, batch, i, limit)
    if partial:  # the head's appended EOS is not the text's
        return Sample(pieces, where, size - 1, size - 2, 0, (size - 3) // (limit - 1) + 1, True)
    if text or size <= limit:  # text: blocks overlapping by one token (see packing)
        blocks = 1 if size <= limit else (size - 2) // (limit - 1) + 1
        return Sample(pieces, where, size, int(mask.sum()), 0, blocks)
    if cfg.truncation == "truncate":
        return Sample(pieces, where, size, int(mask[:limit].sum()), size - limit, 1)
    return Sample(pieces, where, size, 0, size, 0)  # left out (drop), or refused (error)


def _warnings(renderer: ChatRenderer, chosen: list) -> list[str]:
    for rec, doc in chosen:
        if not isinstance(doc, str) and doc.trained and doc.trained[-1] and \
                renderer.drops_system(doc):
            return [f"{rec.where}: the chat template ({renderer.where}) leaves out the system "
                    "prompt of conversations that end with a reply (it only puts it before the "
                    "last user message, as Mistral's templates do): these records train "
                    "without their system prompt. Put the instruction in the first user "
                    "message, or use another template (data.chat_template)."]
    return []
