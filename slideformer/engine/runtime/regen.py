"""Exact clipping with regenerated gradients: the lowest layers keep no host gradient.

With exact global-norm clipping every layer's gradient is needed until the norm is known, which
costs a 4 B/param fp32 host buffer per parameter (16 B/param in all with bf16 weights, their
remainders and fp32 moments). ``ExecShape.regen_layers`` = k drops that buffer for the lowest k
host layers (runtime.shapes.regen_layers, the last ones the backward finishes):

    pass 1  the usual backward; layers k-1 .. 0 (above the device layers) compute their gradient
            on the device for the norm only (no copy to the host); the dL/dx entering layer k-1
            (the gradients leaving layer k's backward) are kept on the device: the boundary
    barrier the norm and the coefficient c are known; a non-finite norm or loss skips the step
            before pass 2 (nothing of the regenerated layers was applied)
    pass 2  layers k-1 .. 0 stream through the slots again, recompute from their activation
            checkpoints (still held: the checkpoint stores keep every layer's inputs until the
            next forward) and backpropagate from the boundary; each gradient goes through the
            gradient ring to the host and its update is submitted at once with hyper(c), as
            without clipping. The other layers, the embedding and the head take the barrier
            updates from their kept gradients afterwards.

Why it is exact: pass 2 runs the same calls on the same inputs as pass 1 (the weights of these
layers change only in pass 2's own updates, each after its layer's recompute), so the gradient
is pass 1's; its update is the barrier mode's ``adam_update(state, g, hyper(c))``. On the CPU
the recompute is deterministic and the result is bit-identical (tests/engine/runtime/
test_regen_clip.py); GPU kernels may not be bit-deterministic, so on CUDA it is the same maths
up to the kernels' own run-to-run rounding. The embedding backward uses pass 1's final dL/dx.

Speculation (runtime.grad_ring) keeps working beside it: the speculative layers are the top
ones and skip the regenerated layers (a regenerated layer has no kept gradient to repair from).
Layers in the NVMe tier cannot be regenerated (their moments are read in barrier order): the
planner places one or the other. Cost: per step k more layer recomputes + backwards and k more
layer loads (weights, and host checkpoints) on the device; the device holds the boundary (one
hidden state per token) through the backward.
"""
from __future__ import annotations

import torch


class Regeneration:
    """The regenerated layers of an executor and the boundary gradients of the current step."""

    def __init__(self, layers: list[int]):
        self.layers = layers
        """Lowest first, contiguous (runtime.shapes.regen_layers)."""
        self.top = layers[-1] if layers else None
        self.boundary: list[torch.Tensor] | None = None
        """dL/dx entering the top regenerated layer, per micro-batch (pass 1 to pass 2)."""

    def __contains__(self, layer: int) -> bool:
        return bool(self.layers) and self.layers[0] <= layer <= self.top

    def __bool__(self) -> bool:
        return bool(self.layers)

    def keep(self, layer: int, gys: list[torch.Tensor]) -> None:
        """Before pass 1 backpropagates ``layer``: keep its incoming gradients if it is the top."""
        if layer == self.top:
            self.boundary = list(gys)

    def take(self) -> list[torch.Tensor]:
        """The boundary gradients for pass 2 (released: pass 2 replaces them layer by layer)."""
        gys, self.boundary = self.boundary, None
        return gys

    def drop(self) -> None:
        """A skipped step: no pass 2."""
        self.boundary = None
