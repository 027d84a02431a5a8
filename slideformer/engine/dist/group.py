"""The ranks of one data-parallel run, as the executor sees them.

Data parallel over micro-batches (DESIGN §9): every rank runs the sliding window over its share
of the step's micro-batches, against ONE host state in shared memory. Per item:

    backward   each rank accumulates its micro-batches' gradient on its device, then the
               gradient is all-reduced (sum), so every rank holds the step's gradient and the
               squared norm it adds to the global norm is the same on every rank: clipping is
               exact and every rank reaches the same decision (clip, skip) on its own
    update     rank r copies only its slice [r/N, (r+1)/N) of the gradient to the shared host
               buffer and runs AdamW on that slice of the shared master weights and moments
    next step  a barrier: every slice is updated before any rank loads a layer again

The loss is divided by the step's labelled tokens over all ranks, so the summed gradient is
that of the one-process step. :class:`Single` is the same interface for one process (it does
nothing), so the executor has no "if distributed" branches.
"""
from __future__ import annotations

import torch

from slideformer.engine.runtime.host_state import HostItem
from slideformer.engine.runtime.moments8 import block_span
from slideformer.engine.runtime.shapes import QBLOCK


class Single:
    """One process: the whole batch, the whole items, no communication."""

    rank, world = 0, 1

    def mine(self, micro_batches: list) -> list:
        return micro_batches

    def span(self, numel: int) -> slice:
        return slice(0, numel)

    def owned(self, item):
        return item

    def reduce(self, t: torch.Tensor) -> None:
        pass

    def step_done(self, wait_updates) -> None:
        pass


class RankGroup:
    """This process's rank in an initialised ``torch.distributed`` process group."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self._parts: dict[str, ItemPart] = {}

    def mine(self, micro_batches: list) -> list:
        """This rank's contiguous share of the step's micro-batches (N divides their count)."""
        k = len(micro_batches) // self.world
        return micro_batches[self.rank * k:(self.rank + 1) * k]

    def span(self, numel: int) -> slice:
        """The elements of an item whose update this rank owns: cut at multiples of QBLOCK, so
        that 8-bit moments (slideformer.engine.runtime.moments8) split between whole blocks."""
        def cut(r: int) -> int:
            return numel if r == self.world else numel * r // self.world // QBLOCK * QBLOCK
        return slice(cut(self.rank), cut(self.rank + 1))

    def owned(self, item: HostItem) -> "ItemPart":
        """The part of ``item`` this rank updates (a view: the shared tensors themselves)."""
        part = self._parts.get(item.name)
        if part is None or part.item is not item:
            part = self._parts[item.name] = ItemPart(item, self.span(item.numel))
        return part

    def reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place (a gradient, the loss)."""
        import torch.distributed as dist
        dist.all_reduce(t)

    def step_done(self, wait_updates) -> None:
        """Wait until every rank's updates of this step are in the shared state."""
        import torch.distributed as dist
        wait_updates()
        dist.barrier()


class ItemPart:
    """A contiguous slice of a host item with the item's fields (w, rem, m, v, g, runs), so
    ``adam_update`` runs on it unchanged; weight decay follows the item's runs."""

    def __init__(self, item: HostItem, span: slice):
        self.item, self.name, self.layout = item, item.name, item.layout
        lo, hi = span.start, span.stop
        self.lo, self.numel, self.has_rem, self.disk = lo, hi - lo, item.has_rem, None
        cut = (lambda t: None if t is None else t[lo:hi])
        moment = (lambda t: block_span(t, lo, hi) if t.dtype == torch.int8 else t[lo:hi])
        self.w, self.rem, self.m, self.v, self.g = (cut(item.w), cut(item.rem), moment(item.m),
                                                    moment(item.v), cut(item.g))
        self.runs = [(max(s, lo) - lo, min(e, hi) - lo, decay) for s, e, decay in item.runs
                     if min(e, hi) > max(s, lo)]

    def fields(self, staged=None):
        return self.rem, self.m, self.v
