"""``prepare_data``: from a DataConfig to cached, fixed-length training and validation sets.

Two cache levels, so that changing a sequence setting never re-tokenizes:

- ``tokens-<key>``: the token store of a source, keyed by (file contents, tokenizer files,
  format, train_on). Expensive; a changed byte in the data or the tokenizer misses.
- ``rows-<key>``: the row layouts of the train and validation sets, keyed by the store keys and
  (max_seq_len, packing, truncation, val_fraction, seed). Cheap, but cached so that a second
  open does no work proportional to the data.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from engine.config import DataConfig
from engine.data import formats, packing
from engine.data.cache import cached, digest, read_meta, source_hash, tokenizer_hash
from engine.data.chat import BUILTIN_WHERE
from engine.data.dataset import SequenceDataset
from engine.data.records import source_files
from engine.data.store import TokenStore
from engine.data.tokenize import build_store
from engine.errors import UserError
from engine.events import Log
from engine.models.tokenizer import TokenizerInfo

HIST_BINS = 20
"""At most this many bins; their width is rounded to 1, 2 or 5 times a power of ten."""


@dataclass(frozen=True)
class DataStats:
    """What the data turned into (shown by the GUI's Data page and ``data inspect``)."""

    format: str
    """text, alpaca, messages or sharegpt (detected or forced)."""
    template: str
    """Chat template used: "model", "built-in ChatML", or "" for plain text."""
    records: int
    """Records read from the training source."""
    train_records: int
    """Records in the training sequences."""
    val_records: int
    """Records in the validation sequences."""
    tokens: int
    """Real (non-padding) tokens in the training sequences."""
    trained_tokens: int
    """Training tokens with a loss target."""
    truncated: int
    """Records cut to max_seq_len (train and validation)."""
    dropped: int
    """Records removed for being longer than max_seq_len (truncation = "drop")."""
    no_target: int
    """Records removed with nothing to train: blank, no assistant reply, or reply cut off."""
    train_sequences: int
    val_sequences: int
    seq_len: int
    packing: bool
    fill: float
    """Fraction of training-sequence positions holding real tokens (the rest is padding)."""
    hist_edges: tuple[int, ...]
    """Record length histogram in tokens, before truncation: bin i is [edges[i], edges[i+1])."""
    hist_counts: tuple[int, ...]
    from_cache: bool
    """True when no tokenization ran (every token store came from the cache)."""


@dataclass(frozen=True)
class PreparedData:
    train: SequenceDataset
    val: SequenceDataset | None
    stats: DataStats


def check_config(cfg: DataConfig) -> None:
    """Reject invalid data settings with one message each."""
    choices = {"format": formats.FORMATS, "train_on": ("assistant", "all"),
               "truncation": ("truncate", "drop", "error")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise UserError(f"data.{name}", f"is {getattr(cfg, name)!r}",
                            f"use one of: {', '.join(allowed)}")
    if cfg.max_seq_len < 2:
        raise UserError("data.max_seq_len", f"is {cfg.max_seq_len}", "use at least 2 tokens")
    if not 0 <= cfg.val_fraction < 1:
        raise UserError("data.val_fraction", f"is {cfg.val_fraction}", "use a value in [0, 1)")
    if cfg.validation and cfg.val_fraction > 0:
        raise UserError("data.val_fraction", "is set together with data.validation",
                        "use either a separate validation file or a held-out fraction")


def prepare_data(cfg: DataConfig, tok: TokenizerInfo, cache_dir: Path | str,
                 emit: Callable | None = None) -> PreparedData:
    """Tokenize (or open from the cache) and lay out the training and validation data.

    Args:
        cfg: the data settings.
        tok: the model's tokenizer and chat template.
        cache_dir: folder of the token cache (created if missing).
        emit: receives Progress and Log events; None discards them.
    """
    check_config(cfg)
    emit = emit or (lambda ev: None)
    cache_dir = Path(cache_dir)
    train, train_key, hit = open_store(cfg.train, "data.train", cfg, tok, cache_dir, emit)
    val = None
    val_key, val_hit = "", True
    if cfg.validation:
        val, val_key, val_hit = open_store(cfg.validation, "data.validation", cfg, tok,
                                           cache_dir, emit)
    if train.meta["builtin_template"] or (val is not None and val.meta["builtin_template"]):
        emit(Log("warning", f"the model has no chat_template: conversations are rendered with "
                 f"the {BUILTIN_WHERE}; the fine-tuned model will expect that format"))
    key = digest(train_key, val_key, cfg.max_seq_len, cfg.packing, cfg.truncation,
                 cfg.val_fraction, cfg.seed)
    folder, _ = cached(cache_dir, f"rows-{key}", lambda tmp: _build_rows(tmp, cfg, train, val))
    meta = read_meta(folder)
    pad = tok.pad_id if tok.pad_id is not None else 0
    train_set = SequenceDataset(train, packing.Layout.load(folder / "train.npz"),
                                cfg.max_seq_len, pad, cfg.packing)
    val_set = None
    if (folder / "val.npz").is_file():
        val_set = SequenceDataset(val or train, packing.Layout.load(folder / "val.npz"),
                                  cfg.max_seq_len, pad, cfg.packing)
    stats = _stats(cfg, train, train_set, val_set, meta, from_cache=hit and val_hit)
    return PreparedData(train_set, val_set, stats)


def open_store(path: str, setting: str, cfg: DataConfig, tok: TokenizerInfo, cache_dir: Path,
               emit: Callable) -> tuple[TokenStore, str, bool]:
    """The token store of one source, from the cache or tokenized now.

    Returns:
        (store, cache key, hit).
    """
    files = source_files(path, setting)
    key = digest(source_hash(cache_dir, files), tokenizer_hash(tok), cfg.format, cfg.train_on)
    task = f"tokenizing {Path(path).name}"
    start = time.perf_counter()
    folder, hit = cached(cache_dir, f"tokens-{key}", lambda tmp: build_store(
        files, cfg.format, tok, cfg.train_on, tmp, emit, task))
    store = TokenStore(folder)
    if hit:
        emit(Log("info", f"{path}: tokens loaded from the cache ({folder.name})"))
    else:
        emit(Log("info", f"{path}: tokenized {store.meta['records']:,} records into "
                 f"{int(store.offsets[-1]):,} tokens in {time.perf_counter() - start:.1f} s"))
    return store, key, hit


def _build_rows(folder: Path, cfg: DataConfig, train: TokenStore,
                val: TokenStore | None) -> dict:
    """Select, split and lay out the rows; writes train.npz (and val.npz) into ``folder``."""
    sel = packing.select(train, cfg.max_seq_len, cfg.truncation)
    tr, va = packing.split(sel, cfg.val_fraction, cfg.seed)
    counts = {"truncated": sel.truncated, "dropped": sel.dropped,
              "no_target": sel.no_target + train.meta["empty"]}
    if val is not None:
        vsel = packing.select(val, cfg.max_seq_len, cfg.truncation)
        for k in counts:
            counts[k] += getattr(vsel, k)
        counts["no_target"] += val.meta["empty"]
        val_docs, val_lengths = vsel.docs, vsel.lengths
    else:
        val_docs, val_lengths = sel.docs[va], sel.lengths[va]
    if len(tr) == 0:
        raise UserError(cfg.train, f"has no records left after filtering "
                        f"({sel.dropped} longer than max_seq_len dropped, {sel.no_target} with "
                        f"nothing to train, {train.meta['empty']} blank)",
                        _nothing_left_fix(cfg))
    packing.layout(sel.docs[tr], sel.lengths[tr], cfg.max_seq_len, cfg.packing,
                   cfg.seed).save(folder / "train.npz")
    if val is not None and not len(val_docs):
        raise UserError(cfg.validation, f"has no records left after filtering ({vsel.dropped} "
                        f"longer than max_seq_len dropped, {vsel.no_target} with nothing to "
                        f"train, {val.meta['empty']} blank)", _nothing_left_fix(cfg))
    if len(val_docs):
        packing.layout(val_docs, val_lengths, cfg.max_seq_len, cfg.packing,
                       cfg.seed).save(folder / "val.npz")
    return dict(counts, train_records=int(len(tr)), val_records=int(len(val_docs)),
                trained_tokens=int(sel.targets[tr].sum()))


def _nothing_left_fix(cfg: DataConfig) -> str:
    if cfg.truncation == "drop":
        return 'raise data.max_seq_len or set data.truncation = "truncate"'
    if cfg.train_on == "assistant":
        return 'check that records have assistant replies, or set data.train_on = "all"'
    return "check the data file's contents"


def _stats(cfg: DataConfig, train: TokenStore, train_set: SequenceDataset,
           val_set: SequenceDataset | None, meta: dict, from_cache: bool) -> DataStats:
    edges, counts = length_histogram(train.lengths)
    layout = train_set.layout
    fmt = train.meta["format"]
    template = ("" if fmt not in formats.CHAT_FORMATS else
                "built-in ChatML" if train.meta["builtin_template"] else "model")
    return DataStats(
        format=fmt, template=template, records=train.meta["records"],
        train_records=meta["train_records"], val_records=meta["val_records"],
        tokens=layout.tokens, trained_tokens=meta["trained_tokens"], truncated=meta["truncated"],
        dropped=meta["dropped"], no_target=meta["no_target"],
        train_sequences=len(train_set), val_sequences=len(val_set) if val_set else 0,
        seq_len=cfg.max_seq_len, packing=cfg.packing,
        fill=layout.tokens / max(1, len(train_set) * cfg.max_seq_len),
        hist_edges=edges, hist_counts=counts,
        from_cache=from_cache)


def length_histogram(lengths: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(edges, counts) of record lengths with round bin widths (e.g. 0, 50, 100, ...)."""
    top = int(lengths.max()) + 1 if len(lengths) else 1
    raw = max(1.0, top / HIST_BINS)
    scale = 10 ** int(np.floor(np.log10(raw)))
    width = next(m * scale for m in (1, 2, 5, 10) if m * scale >= raw)
    edges = np.arange(0, top + width, width, dtype=np.int64)
    counts, _ = np.histogram(lengths, bins=edges)
    return tuple(int(e) for e in edges), tuple(int(c) for c in counts)
