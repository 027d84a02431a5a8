"""``prepare_data``: from a DataConfig to cached, fixed-length training and validation sets.

Two cache levels, so that changing a sequence setting never re-tokenizes:

- ``tokens-<key>``: the token store of a source, keyed by (file contents, tokenizer files, chat
  template, format, field names, train_on, mask_history, max_samples). Expensive; a changed byte
  in the data or the tokenizer misses.
- ``rows-<key>``: the row layouts of the train and validation sets, keyed by the store keys and
  (mixing, max_seq_len, packing, truncation, val_fraction, seed). Cheap, but cached so that a
  second open does no work proportional to the data.

Several training sources (``data.train`` and ``[[data.mix]]``) each get their own store; the
validation share is held out of each before mixing, so a repeated record never lands on both
sides.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from slideformer.engine.config import DataConfig, MixSource
from slideformer.engine.data import formats, packing
from slideformer.engine.data.cache import cached, digest, read_meta, source_hash, tokenizer_hash
from slideformer.engine.data.chat import BUILTIN_WHERE, ChatRenderer
from slideformer.engine.data.dataset import SequenceDataset
from slideformer.engine.data.records import source_files
from slideformer.engine.data.store import StoreSet, TokenStore
from slideformer.engine.data.tokenize import build_store
from slideformer.engine.errors import UserError
from slideformer.engine.events import Log
from slideformer.engine.models.tokenizer import TokenizerInfo

HIST_BINS = 20
"""At most this many bins; their width is rounded to 1, 2 or 5 times a power of ten."""


@dataclass(frozen=True)
class DataStats:
    """What the data turned into (shown by the GUI's Data page and ``data inspect``)."""

    format: str
    """text, alpaca, messages or sharegpt (detected or forced); "a + b" for mixed sources."""
    template: str
    """Chat template used: "model", "built-in ChatML", the override, or "" for plain text."""
    records: int
    """Records read from the training sources."""
    train_records: int
    """Record pieces in the training sequences (a text cut into blocks counts each block)."""
    val_records: int
    """Record pieces in the validation sequences."""
    tokens: int
    """Real (non-padding) tokens in the training sequences."""
    trained_tokens: int
    """Training tokens with a loss target."""
    dropped_tokens: int
    """Tokens of the records that are in no sequence: cut off by truncation, or in records
    left out (too long, nothing to train)."""
    truncated: int
    """Records cut to max_seq_len (train and validation)."""
    split: int
    """Plain-text records cut into blocks of max_seq_len."""
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
    if cfg.max_samples < 0:
        raise UserError("data.max_samples", f"is {cfg.max_samples}", "use 0 (all) or more")
    for i, m in enumerate(cfg.mix):
        if m.weight < 0 or m.samples < 0 or not m.path:
            raise UserError(f"data.mix[{i}]", f"has path {m.path!r}, weight {m.weight}, "
                            f"samples {m.samples}", "give a path, and a weight and samples >= 0")


def sources(cfg: DataConfig) -> list[tuple[str, str, MixSource]]:
    """(path, setting name, mixing) of every training source: data.train, then data.mix."""
    out = [(cfg.train, "data.train", MixSource(cfg.train))]
    return out + [(m.path, f"data.mix[{i}]", m) for i, m in enumerate(cfg.mix)]


def source_digests(cfg: DataConfig, cache_dir: Path | str) -> list[list]:
    """``[setting, path, contents digest, weight, samples]`` of every training source, in order:
    what a checkpoint records of its data (slideformer.engine.train.resume). The digests are
    those of the token cache's keys, remembered in ``cache_dir``."""
    return [[setting, path, source_hash(Path(cache_dir), source_files(path, setting)), m.weight,
             m.samples] for path, setting, m in sources(cfg)]


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
    renderer = ChatRenderer(tok, cfg.chat_template, cfg.enable_thinking)
    opened = [open_store(path, setting, cfg, tok, renderer, cache_dir, emit)
              for path, setting, _ in sources(cfg)]
    train = [store for store, _, _ in opened]
    val, val_key, val_hit = None, "", True
    if cfg.validation:
        val, val_key, val_hit = open_store(cfg.validation, "data.validation", cfg, tok,
                                           renderer, cache_dir, emit)
    if any(s.meta["builtin_template"] for s in train + ([val] if val else [])):
        emit(Log("warning", f"the model has no chat_template: conversations are rendered with "
                 f"the {BUILTIN_WHERE}; the fine-tuned model will expect that format"))
    mixing = [(m.weight, m.samples) for _, _, m in sources(cfg)]
    key = digest([k for _, k, _ in opened], val_key, mixing, cfg.max_seq_len, cfg.packing,
                 cfg.truncation, cfg.val_fraction, cfg.seed)
    folder, _ = cached(cache_dir, f"rows-{key}", lambda tmp: _build_rows(tmp, cfg, train, val))
    meta = read_meta(folder)
    pad = tok.pad_id if tok.pad_id is not None else 0
    pool = train[0] if len(train) == 1 else StoreSet(train)
    train_set = SequenceDataset(pool, packing.Layout.load(folder / "train.npz"),
                                cfg.max_seq_len, pad, cfg.packing)
    val_set = None
    if (folder / "val.npz").is_file():
        val_set = SequenceDataset(val or pool, packing.Layout.load(folder / "val.npz"),
                                  cfg.max_seq_len, pad, cfg.packing)
    hit = all(h for _, _, h in opened) and val_hit
    stats = _stats(cfg, renderer, train, train_set, val_set, meta, from_cache=hit)
    return PreparedData(train_set, val_set, stats)


def open_store(path: str, setting: str, cfg: DataConfig, tok: TokenizerInfo,
               renderer: ChatRenderer, cache_dir: Path,
               emit: Callable) -> tuple[TokenStore, str, bool]:
    """The token store of one source, from the cache or tokenized now.

    Returns:
        (store, cache key, hit).
    """
    files = source_files(path, setting)
    key = digest(source_hash(cache_dir, files), tokenizer_hash(tok), renderer.source,
                 cfg.enable_thinking, cfg.format, cfg.train_on, cfg.mask_history,
                 dataclasses.asdict(cfg.columns), sorted(cfg.ignore_fields), cfg.max_samples)
    task = f"tokenizing {Path(path).name}"
    start = time.perf_counter()
    folder, hit = cached(cache_dir, f"tokens-{key}", lambda tmp: build_store(
        files, cfg, tok, renderer, tmp, emit, task))
    store = TokenStore(folder)
    if hit:
        emit(Log("info", f"{path}: tokens loaded from the cache ({folder.name})"))
    else:
        emit(Log("info", f"{path}: tokenized {store.meta['records']:,} records into "
                 f"{int(store.offsets[-1]):,} tokens in {time.perf_counter() - start:.1f} s"))
    return store, key, hit


_COUNTS = ("truncated", "dropped", "no_target", "split")


def _build_rows(folder: Path, cfg: DataConfig, train: list[TokenStore],
                val: TokenStore | None) -> dict:
    """Select, split, mix and lay out the rows; writes train.npz (and val.npz) into ``folder``."""
    counts = dict.fromkeys(_COUNTS, 0)
    counts["dropped_tokens"] = 0
    tr_parts, va_parts, base = [], [], 0
    for store, (_, _, mix) in zip(train, sources(cfg)):
        sel = _select(store, cfg, counts)
        tr, va = packing.split(sel, cfg.val_fraction, cfg.seed)
        tr = _mixed(tr, mix, cfg.seed + len(tr_parts))
        tr_parts.append(_pieces(sel, tr, base))
        va_parts.append(_pieces(sel, va, base))
        base += len(store)
    tr = _concat(tr_parts)
    if val is not None:
        vsel = _select(val, cfg, counts)
        va = _pieces(vsel, np.arange(len(vsel.docs)), 0)
    else:
        va = _concat(va_parts)
    if len(tr[0]) == 0:
        raise UserError(cfg.train, f"has no records left after filtering "
                        f"({counts['dropped']} longer than max_seq_len dropped, "
                        f"{counts['no_target']} with nothing to train or blank)",
                        _nothing_left_fix(cfg))
    packing.layout(*tr[:3], cfg.max_seq_len, cfg.packing, cfg.seed).save(folder / "train.npz")
    if val is not None and not len(va[0]):
        raise UserError(cfg.validation, f"has no records left after filtering ("
                        f"{vsel.dropped} longer than max_seq_len dropped, {vsel.no_target} "
                        "with nothing to train or blank)", _nothing_left_fix(cfg))
    if len(va[0]):
        packing.layout(*va[:3], cfg.max_seq_len, cfg.packing, cfg.seed).save(folder / "val.npz")
    return dict(counts, train_records=int(len(tr[0])), val_records=int(len(va[0])),
                trained_tokens=int(tr[3].sum()))


def _select(store: TokenStore, cfg: DataConfig, counts: dict) -> packing.Selection:
    """``packing.select`` of one store, its filter counts added to ``counts``."""
    sel = packing.select(store, cfg.max_seq_len, cfg.truncation)
    for k in _COUNTS:
        counts[k] += getattr(sel, k)
    counts["no_target"] += store.meta["empty"]
    # Blocks of one text overlap by one token: count each token once.
    covered = int(sel.lengths.sum()) - (len(sel.docs) - len(np.unique(sel.docs)))
    counts["dropped_tokens"] += int(store.lengths.sum()) - covered
    return sel


def _mixed(positions: np.ndarray, mix: MixSource, seed: int) -> np.ndarray:
    """The positions a source contributes: all once, or ``samples`` / ``weight`` times as many
    (whole repeats plus a seeded random remainder)."""
    n = len(positions)
    want = mix.samples if mix.samples else round(mix.weight * n)
    if want == n or n == 0:
        return positions
    rng = np.random.default_rng([seed, 0x313])
    repeats, rest = divmod(want, n)
    extra = np.sort(rng.permutation(n)[:rest])
    return np.concatenate([np.tile(positions, repeats), positions[extra]])


def _pieces(sel: packing.Selection, positions: np.ndarray, base: int) -> tuple:
    """(docs + base, starts, lengths, targets) of the selected pieces."""
    return (sel.docs[positions] + base, sel.starts[positions], sel.lengths[positions],
            sel.targets[positions])


def _concat(parts: list[tuple]) -> tuple:
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))


def _nothing_left_fix(cfg: DataConfig) -> str:
    if cfg.truncation == "drop":
        return 'raise data.max_seq_len or set data.truncation = "truncate"'
    if cfg.train_on == "assistant":
        return 'check that records have assistant replies, or set data.train_on = "all"'
    return "check the data file's contents"


def _stats(cfg: DataConfig, renderer: ChatRenderer, train: list[TokenStore],
           train_set: SequenceDataset, val_set: SequenceDataset | None, meta: dict,
           from_cache: bool) -> DataStats:
    edges, counts = length_histogram(np.concatenate([s.lengths for s in train]))
    layout = train_set.layout
    fmts = list(dict.fromkeys(s.meta["format"] for s in train))
    chat = any(f in formats.CHAT_FORMATS for f in fmts)
    template = ("" if not chat else "built-in ChatML" if renderer.builtin else
                cfg.chat_template or "model")
    return DataStats(
        format=" + ".join(fmts), template=template,
        records=sum(s.meta["records"] for s in train),
        train_records=meta["train_records"], val_records=meta["val_records"],
        tokens=layout.tokens, trained_tokens=meta["trained_tokens"],
        dropped_tokens=meta["dropped_tokens"], truncated=meta["truncated"],
        split=meta["split"], dropped=meta["dropped"], no_target=meta["no_target"],
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
