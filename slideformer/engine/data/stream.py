"""The training batch stream: seeded epochs of micro-batches, resumable exactly.

Epoch e visits the rows in the order of a permutation drawn from ``(seed, e)``, so the order of
any epoch can be rebuilt from two integers; the stream's position is (epoch, step within the
epoch). Rows left over after the last full optimizer step of an epoch are skipped for that epoch
(a different few each epoch, since the order is reshuffled).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from slideformer.engine.data.dataset import MicroBatch, SequenceDataset
from slideformer.engine.errors import UserError


class BatchStream:
    """Optimizer steps of ``grad_accum`` micro-batches of ``micro_batch`` rows, forever."""

    def __init__(self, dataset: SequenceDataset, micro_batch: int, grad_accum: int = 1,
                 seed: int = 0):
        if micro_batch < 1 or grad_accum < 1:
            raise UserError("train.micro_batch / train.grad_accum",
                            f"must be >= 1 (got {micro_batch} and {grad_accum})",
                            "use positive batch settings")
        self.dataset, self.micro_batch, self.grad_accum, self.seed = (
            dataset, micro_batch, grad_accum, seed)
        rows_per_step = micro_batch * grad_accum
        self.steps_per_epoch = len(dataset) // rows_per_step
        if self.steps_per_epoch == 0:
            raise UserError("data.train", f"has {len(dataset)} sequences, fewer than one "
                            f"optimizer step needs (micro_batch x grad_accum = {rows_per_step})",
                            "lower train.micro_batch or train.grad_accum, or add data")
        self._epoch, self._step = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    @property
    def epoch(self) -> float:
        """Progress in epochs, e.g. 1.25 a quarter into the second epoch."""
        return self._epoch + self._step / self.steps_per_epoch

    def next_step(self) -> list[MicroBatch]:
        """The micro-batches of the next optimizer step."""
        rows_per_step = self.micro_batch * self.grad_accum
        rows = self._order[self._step * rows_per_step:(self._step + 1) * rows_per_step]
        out = [self.dataset.batch(rows[i:i + self.micro_batch])
               for i in range(0, rows_per_step, self.micro_batch)]
        self._step += 1
        if self._step == self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
            self._order = self._permutation(self._epoch)
        return out

    def state_dict(self) -> dict:
        """The stream position (small, JSON-serialisable)."""
        return {"epoch": self._epoch, "step": self._step, "seed": self.seed,
                "rows": len(self.dataset), "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position: the same batches an uninterrupted run would see."""
        same_position(self.state_dict(), state, ("seed", "rows", "micro_batch", "grad_accum"))
        if not 0 <= state["step"] < self.steps_per_epoch or state["epoch"] < 0:
            raise UserError("checkpoint data position", f"step {state['step']} of epoch "
                            f"{state['epoch']} is out of range", "use an intact checkpoint")
        self._epoch, self._step = int(state["epoch"]), int(state["step"])
        self._order = self._permutation(self._epoch)


def iterate_eval(dataset: SequenceDataset, micro_batch: int) -> Iterator[MicroBatch]:
    """Every row of ``dataset`` in order, ``micro_batch`` at a time (the last may be smaller)."""
    for start in range(0, len(dataset), micro_batch):
        yield dataset.batch(range(start, min(start + micro_batch, len(dataset))))


def same_position(mine: dict, state: dict, keys) -> None:
    """Refuse a checkpoint's data position (``state``) saved with other data or batch settings
    than this stream's (``mine``: its state_dict) in any of ``keys``."""
    for key in keys:
        if state.get(key) != mine[key]:
            raise UserError("checkpoint data position", f"was saved with {key} = "
                            f"{state.get(key)!r}, but this run has {mine[key]!r}",
                            "resume with the same data and batch settings as the "
                            "checkpointed run")
