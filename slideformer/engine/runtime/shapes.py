"""The executor's buffer shapes and fixed sizes, shared with the planner.

The planner predicts the memory of the buffers the executor allocates; both read the shapes and
sizes from here, so the plan does not import the runtime it plans for. A leaf: it imports no
other engine module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

GRAD_RING = 4
"""Host gradient buffers shared by the decoder layers that own none: the backward may run this
many layers ahead of the CPU updates."""
DEVICE_CHUNK = 1 << 24
"""Parameters per chunk of the device-side update (64 MB of fp32 scratch; few kernel launches)."""


@dataclass(frozen=True)
class ExecShape:
    """Buffer shapes of the executor (from the plan)."""
    micro_batch: int
    seq_len: int
    n_micro: int
    """Micro-batches per step (gradient accumulation), all processed layer-wise."""
    slots: int
    """K parameter slots (clamped to the layer count)."""
    checkpoints: str = "gpu"
    """Where activation checkpoints live: gpu or host."""
    gpu_checkpoints: int = 0
    """With host checkpoints, the last this-many decoder layers keep theirs on the GPU instead
    (runtime.activations.SplitStore): host RAM the planner takes from spare VRAM when RAM is
    short."""
    head_chunk: int = 4096
    """Tokens per chunk of the LM-head cross-entropy."""
    grad_slots: int = 2
    device_update: bool = False
    """The embedding and head are updated on the device (remainders and moments in VRAM)."""
    device_layers: int = 0
    """Decoder layers 0 .. device_layers-1 live in VRAM with their optimizer state: no slot,
    no PCIe, updated on the device."""
    grad_ring: int = GRAD_RING
    """Host gradient buffers shared by the layers that own none, without clipping."""
    spec_layers: int = 0
    """With exact clipping, the last host layers (in RAM) updated speculatively during the
    backward (:func:`speculative_layers`); each keeps a pre-update snapshot."""
    regen_layers: int = 0
    """With exact clipping, the lowest host layers (:func:`regen_layers`) own no host gradient
    buffer: the backward computes their gradient for the global norm only, and a second pass
    recomputes it once the clip coefficient is known (runtime.regen)."""
    rollout_prompts: int = 0
    """GRPO: prompts whose groups are decoded in one batch between steps (the planner's pick,
    at most grpo.prompts_together: the most whose KV caches fit); 0: no sampling."""
    ff_tokens: int = 0
    """Tokens per tile of each layer's feed-forward half (models.layers.tiles: its forward, and
    its recompute + backward); 0: a micro-batch's tokens at once. A long sequence's MLP
    intermediates (tokens x intermediate width, several of them) then take a tile's memory."""

    def describe(self, device: str = "GPU") -> str:
        """The executor's choices in a line, as a run log states them, e.g. "4 slots,
        checkpoints on the GPU, 9 speculative layers, embedding and head updated on the
        GPU"; ``device``: what to call the compute device ("CPU" for the CPU backend, whose
        "device" checkpoints and updates are in host memory)."""
        parts = [f"{self.slots} slot{'s' * (self.slots != 1)}", "checkpoints on the " + (
            device if self.checkpoints == "gpu" else "host" + (
                f" (those of the top {self.gpu_checkpoints} on the {device})"
                if self.gpu_checkpoints else ""))]
        for n, what in ((self.device_layers, "decoder layer{} updated on the " + device),
                        (self.spec_layers, "speculative layer{}"),
                        (self.regen_layers, "regenerated layer{}")):
            if n:
                parts.append(f"{n} " + what.format("s" * (n != 1)))
        if self.device_update:
            parts.append("embedding and head updated on the " + device)
        if self.ff_tokens:
            parts.append(f"tiles of {self.ff_tokens:,} tokens")
        return ", ".join(parts)


FF_TILE = 16384
"""Micro-batches of more tokens than this run each layer in tiles (ExecShape.ff_tokens): a long
sequence's MLP intermediates (several tokens x intermediate-width tensors: ~10 GiB for one
64K-token sequence of an 8B) and, where attention allows it, its queries' activations
(models.recompute.query_tiles) then take a tile's memory. Micro-batches of at most this many
tokens run untiled."""
TILE_ROWS = 512
"""Positions of each row a tile holds at least (:func:`ff_tile`): a tile of queries attends as
a block of that many rows or more."""
MIN_TILE = 4096
"""Tokens per tile at the least: each tile's matmuls stay large enough (4096 rows) to run at
the GPU's full rate."""


def ff_tile(spec, tokens: int, lora_dropout: float = 0.0, rows: int = 1) -> int:
    """ExecShape.ff_tokens for micro-batches of ``rows`` rows and ``tokens`` tokens: where
    they have more than :data:`FF_TILE` and tiling computes the same (models.layers.tiles: no
    router loss, no LoRA dropout), tiles of :data:`MIN_TILE` tokens, or of :data:`TILE_ROWS`
    positions of every row if more (at most FF_TILE); else 0 (untiled)."""
    moe = getattr(spec, "moe", None)
    if tokens <= FF_TILE or lora_dropout or (moe is not None and moe.aux_coef):
        return 0
    return min(FF_TILE, max(MIN_TILE, TILE_ROWS * rows))


def speculative_layers(num_layers: int, device_layers: int, depth: int,
                       disk: Iterable[int] = ()) -> list[int]:
    """The decoder layers that update speculatively with clipping, last layer first: the last
    ``depth`` layers updated on the host whose state is in RAM."""
    skip = set(disk)
    host = [i for i in reversed(range(min(device_layers, num_layers), num_layers)) if i not in skip]
    return host[:max(depth, 0)]


def borrowed_layers(shape: ExecShape, num_layers: int, disk: Iterable[int] = ()) -> list[int]:
    """The decoder layers that own no host gradient buffer under exact clipping: the
    speculative ones (their snapshot holds it) and the regenerated ones (the ring serves them);
    ``disk``: the layers in the NVMe tier (never speculative)."""
    regen = regen_layers(num_layers, shape.device_layers, shape.regen_layers)
    return speculative_layers(num_layers, shape.device_layers, shape.spec_layers,
                              list(disk) + regen) + regen


def device_items(shape: ExecShape, num_layers: int) -> list[str]:
    """The items updated on the device (ExecShape.device_update, device_layers): their gradient
    stays there, so their host state has no gradient buffer."""
    layers = [f"layer{i}" for i in range(min(shape.device_layers, num_layers))]
    return layers + (["embed", "head"] if shape.device_update else [])


def regen_layers(num_layers: int, device_layers: int, count: int) -> list[int]:
    """The decoder layers whose gradient is regenerated with clipping, lowest first: the
    ``count`` layers above the device layers (contiguous, so one boundary gradient serves them)."""
    start = min(device_layers, num_layers)
    return list(range(start, min(start + max(count, 0), num_layers)))


def disk_layers(num_layers: int, count: int) -> list[int]:
    """The ``count`` decoder layers whose state goes to disk, spread evenly over the depth."""
    count = min(max(count, 0), num_layers)
    return [i for i in range(num_layers) if (i + 1) * count // num_layers > i * count // num_layers]


# 4M elements: 16 MB of fp32 scratch, about 1 MB per thread on a 16-core CPU (L2-resident),
# and long enough that per-op launch overhead stays small.
CHUNK = 1 << 22
"""Parameters per chunk of the CPU AdamW update (slideformer.engine.runtime.host_state)."""

ALIGN = 4096
"""O_DIRECT alignment of buffers, offsets and lengths (the logical block size of NVMe disks)."""
BUFFERS = 3
"""NVMe staging buffers: one item updating, one read ahead, one written behind."""


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


QBLOCK = 256
"""Values per block of the 8-bit AdamW moments (``optim.moments_dtype = "int8"``,
slideformer.engine.runtime.moments8)."""
QBLOCK_BYTES = QBLOCK + 4
"""One such block as stored: its QBLOCK one-byte codes, then its fp32 scale."""
QCHUNK = 1 << 20
"""Values per chunk of the PyTorch-op update with 8-bit moments (the fallback, and items updated
on the device): its requantise holds QCHUNK_TEMP bytes of temporaries a value, 14 MiB."""
QCHUNK_TEMP = 14
"""Peak temporaries of moments8.quantise, bytes a value (profiler, tests/engine/runtime/
test_moments_int8.py)."""


def moment_numel(numel: int, dtype: torch.dtype) -> int:
    """Elements of the tensor that holds one AdamW moment of ``numel`` values: ``numel`` for
    float moments; for ``torch.int8`` (the 8-bit block format) the bytes of its blocks."""
    return -(-numel // QBLOCK) * QBLOCK_BYTES if dtype == torch.int8 else numel


def file_bytes(numel: int, compute_dtype: torch.dtype, moments_dtype: torch.dtype,
               remainders: bool = False) -> int:
    """Bytes of one item's file in the NVMe tier, and of one staging buffer (fields padded)."""
    mo = moment_numel(numel, moments_dtype) * moments_dtype.itemsize
    sizes = [mo, mo] + ([numel * 2] if remainders and compute_dtype == torch.bfloat16 else [])
    return sum(padded(b) for b in sizes)
