"""Fixed-length sequences over a token store, and the micro-batches the trainer consumes.

Labels are already shifted: ``labels[b, t]`` is the target of the logits at position t, i.e.
``input_ids[b, t + 1]`` of the same document, or -100 where nothing is trained: masked prompt
tokens, padding, and the last token of every document (its successor belongs to another
document or is padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from slideformer.engine.data.packing import Layout
from slideformer.engine.data.store import TokenStore
from slideformer.engine.kernels import IGNORE

if TYPE_CHECKING:  # preparing and inspecting data needs no torch; a batch imports it
    import torch


@dataclass
class MicroBatch:
    """B rows of T tokens."""

    input_ids: torch.Tensor
    """(B, T) int64."""
    labels: torch.Tensor
    """(B, T) int64, shifted; -100 where not trained."""
    doc_ids: torch.Tensor | None
    """(B, T) int64 document index within each row (padding has its own), so attention stays
    inside a document; None when no row holds more than one document (plain causal attention is
    then exact, since padding only follows the real tokens)."""

    @property
    def num_targets(self) -> int:
        """Trained tokens (labels other than -100)."""
        return int((self.labels != IGNORE).sum())


class SequenceDataset:
    """Rows of ``seq_len`` tokens assembled on demand from a memory-mapped store."""

    def __init__(self, store: TokenStore, layout: Layout, seq_len: int, pad_id: int,
                 packed: bool):
        self.store, self.layout = store, layout
        self.seq_len, self.pad_id, self.packed = seq_len, pad_id, packed

    def __len__(self) -> int:
        return len(self.layout)

    @property
    def tokens(self) -> int:
        """Real (non-padding) tokens in all rows."""
        return self.layout.tokens

    def batch(self, rows: Sequence[int]) -> MicroBatch:
        """The micro-batch made of ``rows`` (in that order)."""
        import torch

        shape = (len(rows), self.seq_len)
        ids = np.full(shape, self.pad_id, np.int64)
        labels = np.full(shape, IGNORE, np.int64)
        doc = np.zeros(shape, np.int64)
        most = 0
        for b, r in enumerate(rows):
            most = max(most, self._fill(int(r), ids[b], labels[b], doc[b]))
        return MicroBatch(torch.from_numpy(ids), torch.from_numpy(labels),
                          torch.from_numpy(doc) if most > 1 else None)

    def _fill(self, r: int, ids: np.ndarray, labels: np.ndarray, doc: np.ndarray) -> int:
        """Write row ``r`` into the given (T,) arrays; returns its number of documents."""
        lo, hi = int(self.layout.row_ptr[r]), int(self.layout.row_ptr[r + 1])
        pos = 0
        for k, s in enumerate(range(lo, hi)):
            n = int(self.layout.seg_len[s])
            tokens, mask = self.store.doc(int(self.layout.seg_doc[s]), n,
                                          int(self.layout.seg_start[s]))
            ids[pos:pos + n] = tokens
            labels[pos:pos + n - 1] = np.where(mask[1:] != 0, tokens[1:], IGNORE)
            doc[pos:pos + n] = k
            pos += n
        doc[pos:] = hi - lo  # padding: its own document
        return hi - lo
