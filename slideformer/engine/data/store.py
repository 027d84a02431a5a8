"""The token store: every document of a source, tokenized, as memory-mapped flat arrays.

Files of a store folder (all little-endian, raw or .npy):

=============  ============  ===============================================================
tokens.bin     int32 (N,)    token ids of all documents, concatenated
mask.bin       uint8 (N,)    1 where the token is a training target
offsets.npy    int64 (D+1,)  start of each document in tokens.bin
targets.npy    int32 (D,)    trained tokens per document
origin.npy     int32 (D, 2)  (file index, line) where each document's record starts
meta.json                    format, file names, record counts, template used (written last)
=============  ============  ===============================================================

Only the two per-token arrays are large, and they are memory-mapped, so opening a store costs
nothing whatever its size.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from slideformer.engine.data.cache import read_meta
from slideformer.engine.testhooks import pause_at


class StoreWriter:
    """Appends encoded batches to the files of a store being built (a context manager)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._tokens = open(folder / "tokens.bin", "wb")
        self._mask = open(folder / "mask.bin", "wb")
        self.lengths: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.origin: list[np.ndarray] = []

    def append(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray,
               origin: np.ndarray) -> None:
        """Add documents: flat ids/mask, per-document lengths and (file, line) origins."""
        self._tokens.write(ids.astype("<i4", copy=False).tobytes())
        pause_at("store.append")
        self._mask.write(mask.astype(np.uint8, copy=False).tobytes())
        self.lengths.append(lengths)
        trained = np.zeros(len(lengths), np.int64)
        full = lengths > 0  # reduceat would count an empty document's neighbour
        if full.any():
            starts = (np.cumsum(lengths) - lengths)[full]
            trained[full] = np.add.reduceat(mask.astype(np.int64), starts)
        self.targets.append(trained.astype(np.int32))
        self.origin.append(origin.astype(np.int32))

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """On success flush to disk and write the small arrays (the caller writes meta.json
        last); on failure just close the files."""
        for f in (self._tokens, self._mask):
            if exc_type is None:
                f.flush()
                os.fsync(f.fileno())
            f.close()
        if exc_type is not None:
            return
        lengths = _cat(self.lengths, np.int64, (0,))
        np.save(self.folder / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(
            np.int64))
        np.save(self.folder / "targets.npy", _cat(self.targets, np.int32, (0,)))
        np.save(self.folder / "origin.npy", _cat(self.origin, np.int32, (0, 2)))


def _cat(parts: list[np.ndarray], dtype, empty_shape) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(empty_shape, dtype)


class TokenStore:
    """Read-only view of a store folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = read_meta(folder)
        self.offsets = np.load(folder / "offsets.npy")
        self.targets = np.load(folder / "targets.npy")
        self.origin = np.load(folder / "origin.npy")
        self.tokens = _memmap(folder / "tokens.bin", np.int32)
        self.mask = _memmap(folder / "mask.bin", np.uint8)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def lengths(self) -> np.ndarray:
        """(D,) tokens per document."""
        return np.diff(self.offsets)

    def doc(self, d: int, n: int | None = None,
            skip: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Ids and target mask of document ``d`` (``n`` tokens from token ``skip`` when given)."""
        start, end = int(self.offsets[d]) + skip, int(self.offsets[d + 1])
        if n is not None:
            end = min(end, start + n)
        return self.tokens[start:end], self.mask[start:end]

    def where(self, d: int) -> str:
        """``file:line`` of the record that document ``d`` came from."""
        file, line = self.origin[d]
        return f"{self.meta['files'][int(file)]}:{int(line)}"


class StoreSet:
    """Several token stores seen as one (mixed sources): document d of the set is document
    ``d - base[i]`` of store i."""

    def __init__(self, stores: list[TokenStore]):
        self.stores = stores
        self.base = np.concatenate([[0], np.cumsum([len(s) for s in stores])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.base[-1])

    def _find(self, d: int) -> tuple[TokenStore, int]:
        i = int(np.searchsorted(self.base, d, side="right")) - 1
        return self.stores[i], d - int(self.base[i])

    def doc(self, d: int, n: int | None = None,
            skip: int = 0) -> tuple[np.ndarray, np.ndarray]:
        store, local = self._find(d)
        return store.doc(local, n, skip)

    def where(self, d: int) -> str:
        store, local = self._find(d)
        return store.where(local)


def _memmap(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
