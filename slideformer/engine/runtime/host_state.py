"""Host-side model state of one window item, and the CPU AdamW update that refreshes it.

Per parameter, for bf16 compute (DESIGN §3.2):
  w    bf16, the copy sent to the GPU (pinned under CUDA)
  rem  16-bit remainder: w and rem are the high and low halves of bits(master) + 0x8000, so the
       fp32 master is exact and w is the master rounded to nearest
  m, v AdamW moments, fp32 (or as named options bf16, or 8-bit blocks of codes and scales:
       slideformer.engine.runtime.moments8, 1.016 bytes a value)
  g    fp32 gradient, written by the device->host copy of the item's accumulated gradient;
       None for decoder layers trained without clipping: their gradients pass through the
       executor's small ring of host buffers instead (a layer's gradient is dead once its update
       ran, and without clipping that update starts as soon as the gradient lands)
For fp32 compute, ``w`` is the master itself and there is no remainder. For an item in the NVMe
tier (slideformer.engine.runtime.nvme), m and v (and optionally rem) live in its file instead: the update
gets them in a staging buffer (``staged``), a checkpoint as a mapping of the file
(:meth:`HostItem.state_tensors`); those attributes are then None.

Adding half a bf16 ulp (0x8000) to the bit pattern before taking the high half rounds to nearest
(ties away from zero; PyTorch's cast rounds ties to even, which differs only on exact ties), and
keeping the low half makes reconstruction exact. Both directions are a strided int16 copy per
half and one integer add, with no shifts or widening conversions.

The update runs chunk by chunk through an fp32 scratch buffer small enough to stay in the CPU's
caches (reconstruct -> fused AdamW -> split), so memory is streamed once, as by a plain
``torch.optim.AdamW(fused=True)`` over fp32 parameters.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
import math
import sys

import torch

from slideformer.engine.kernels import cpu_adam
from slideformer.engine.models.spec import Layout, decayed
from slideformer.engine.runtime import moments8
from slideformer.engine.runtime.shapes import CHUNK, QBLOCK, QCHUNK, moment_numel

assert sys.byteorder == "little", "the bf16/remainder split assumes a little-endian CPU"



@dataclass(frozen=True)
class AdamHyper:
    """AdamW hyper-parameters of one step (torch.optim.AdamW semantics)."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    """1-based step count for bias correction."""
    grad_scale: float = 1.0
    """Multiplier applied to the gradient first (the global-norm clipping coefficient)."""


def decay_runs(layout: Layout) -> list[tuple[int, int, bool]]:
    """Contiguous (start, end, decay) runs: norms, biases and other vectors get no weight decay
    (models.spec.decayed)."""
    runs: list[tuple[int, int, bool]] = []
    for name, off, shape in layout.entries:
        n, decay = math.prod(shape), decayed(name, shape)
        if runs and runs[-1][2] == decay and runs[-1][1] == off:
            runs[-1] = (runs[-1][0], off + n, decay)
        else:
            runs.append((off, off + n, decay))
    return runs


class HostItem:
    """Host state (weights, remainder, moments, gradient) of one window item.

    ``tier``: an NVMe tier (slideformer.engine.runtime.nvme.NvmeTier) that keeps this item's moments (and
    remainder) on disk if it chose the item. ``grad``: whether the item owns a gradient buffer.
    """

    def __init__(self, name: str, layout: Layout, compute_dtype: torch.dtype,
                 moments_dtype: torch.dtype, alloc_pinned, alloc, tier=None, grad: bool = True):
        self.name, self.layout, self.numel = name, layout, layout.numel
        self.has_rem = compute_dtype == torch.bfloat16
        fields = {"rem": torch.int16} if self.has_rem else {}
        fields.update(m=moments_dtype, v=moments_dtype)
        self.disk = None if tier is None else tier.place(name, self.numel, fields)
        """The item's file in the NVMe tier, holding the fields it names; None: all in RAM."""
        on_disk = () if self.disk is None else self.disk.fields
        self.w = alloc_pinned(self.numel, compute_dtype)
        ram = {k: alloc(moment_numel(self.numel, d), d) for k, d in fields.items() if k not in on_disk}
        self.rem, self.m, self.v = ram.get("rem"), ram.get("m"), ram.get("v")
        self.g = alloc_pinned(self.numel, torch.float32) if grad else None
        self.runs = decay_runs(layout)

    def fields(self, staged: dict[str, torch.Tensor] | None = None):
        """(rem, m, v): the RAM tensors, or for the fields on disk those of ``staged``."""
        staged = staged or {}
        return tuple(staged.get(k, getattr(self, k)) for k in ("rem", "m", "v"))

    @contextmanager
    def _remainder(self, write: bool):
        """The remainder for the block (read from the tier, and written back if ``write``)."""
        if self.rem is not None or not self.has_rem:
            yield self.rem
        else:
            with self.disk.staged(write) as staged:
                yield staged["rem"]

    def set_master(self, master: torch.Tensor) -> None:
        """Set the state from fp32 (or any float) values; moments untouched."""
        with self._remainder(write=True) as rem:
            for s in range(0, self.numel, CHUNK):
                e = min(s + CHUNK, self.numel)
                if rem is None:
                    self.w[s:e].copy_(master[s:e])
                else:  # split works in place: give it a private fp32 copy
                    split_master(master[s:e].to(torch.float32, copy=True), self.w[s:e], rem[s:e])

    def master(self) -> torch.Tensor:
        """The exact fp32 master weights (a new tensor)."""
        if not self.has_rem:
            return self.w.float().clone()
        out = torch.empty(self.numel, dtype=torch.float32)
        with self._remainder(write=False) as rem:
            join_master(self.w, rem, out)
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores (gradients are transient), the same for RAM and disk items.

        Fields on disk come as tensors over a mapping of the item's file: the checkpoint writer
        reads them from the file, the reader writes them into it (call with no update running).
        """
        rem, m, v = self.fields(None if self.disk is None else self.disk.mapped())
        d = {"w": self.w, "m": m, "v": v}
        if rem is not None:
            d["rem"] = rem
        return d


def join_master(w: torch.Tensor, rem: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) = exact master from bf16 ``w`` and the stored low half ``rem``.

    ``rem`` holds the low 16 bits of ``bits(master) + 0x8000`` and ``w`` its high 16 bits, so
    the master is two interleaving copies and one integer subtraction (little-endian layout).
    """
    o16 = out.view(torch.int16)
    o16[0::2].copy_(rem)
    o16[1::2].copy_(w.view(torch.int16))
    out.view(torch.int32).sub_(0x8000)
    return out


def split_master(master: torch.Tensor, w: torch.Tensor, rem: torch.Tensor) -> None:
    """Write bf16 ``w`` (nearest, ties away from zero) and ``rem`` of fp32 ``master``.

    Overwrites ``master`` (it is the update's scratch buffer).
    """
    master.view(torch.int32).add_(0x8000)
    m16 = master.view(torch.int16)
    w.view(torch.int16).copy_(m16[1::2])
    rem.copy_(m16[0::2])


class AdamWorkspace:
    """Reusable fp32 scratch for the chunked update (one per updating thread, or one on the
    device for the items updated there). ``moments``: False when the moments are fp32 (updated
    in place, so their scratch is never needed)."""

    def __init__(self, chunk: int = CHUNK, device: torch.device | str = "cpu", moments: bool = True):
        self.p = torch.empty(chunk, dtype=torch.float32, device=device)
        self.m = torch.empty(chunk if moments else 0, dtype=torch.float32, device=device)
        self.v = torch.empty(chunk if moments else 0, dtype=torch.float32, device=device)


class DeviceItem:
    """The optimizer state of an item updated on the device (DESIGN: spare VRAM keeps some
    items' master weights and moments next to their compute, sparing the CPU and PCIe).

    Same fields and layout as :class:`HostItem` (``w``, ``rem``, ``m``, ``v``, ``g``), so
    :func:`adam_update` runs on it unchanged; ``w`` and ``g`` may be buffers the executor owns
    already (the resident embedding and head). The host item stays the copy that checkpoints
    and exports read: :meth:`push` and :meth:`pull` move the state between the two.
    """

    def __init__(self, host: HostItem, alloc, w: torch.Tensor | None = None,
                 g: torch.Tensor | None = None):
        if host.disk is not None:
            raise ValueError(f"{host.name}: an item in the NVMe tier cannot be updated on the device")
        self.host, self.name, self.layout, self.numel = host, host.name, host.layout, host.numel
        self.has_rem, self.runs, self.disk = host.has_rem, host.runs, None
        self.w = alloc(host.numel, host.w.dtype) if w is None else w
        self.rem = alloc(host.numel, torch.int16) if host.has_rem else None
        self.m, self.v = alloc(host.m.numel(), host.m.dtype), alloc(host.v.numel(), host.v.dtype)
        self.g = alloc(host.numel, torch.float32) if g is None else g

    def fields(self, staged=None):
        return self.rem, self.m, self.v

    def _pairs(self):
        return [(a, b) for a, b in ((self.w, self.host.w), (self.rem, self.host.rem),
                                    (self.m, self.host.m), (self.v, self.host.v)) if a is not None]

    def push(self) -> None:
        """Host state -> device (before the first step, or after the host state was replaced)."""
        for dev, host in self._pairs():
            dev.copy_(host)

    def pull(self) -> None:
        """Device state -> host (before a checkpoint or export reads the host items)."""
        for dev, host in self._pairs():
            host.copy_(dev)


def adam_update(item: HostItem, hp: AdamHyper, ws: AdamWorkspace, native: bool | None = None,
                staged: dict[str, torch.Tensor] | None = None,
                grad: torch.Tensor | None = None, out=None) -> None:
    """One AdamW step on the item's master weights from ``grad`` (default ``item.g``);
    refreshes ``item.w``.

    bf16 weights, and any CPU weights with 8-bit moments, go through the one-pass compiled
    kernel when it is available (``native``: None = when available); everything else, and the
    reference, through a chunked chain of PyTorch ops (on the tensors' device). ``staged``: the
    item's disk fields in a tier buffer.
    ``out``: an object with ``w``, ``rem``, ``m``, ``v`` shaped as the item's (RAM fields only):
    the new state goes there and the item's own stays as it was (the speculative updates of
    runtime.grad_ring); the same values as an update in place.
    """
    rem, mom1, mom2 = item.fields(staged)
    g = item.g if grad is None else grad
    chunk = ws.p.numel()
    native = cpu_adam.native_available() if native is None else native and cpu_adam.native_available()
    to = (item.w, rem, mom1, mom2) if out is None else (out.w, out.rem, out.m, out.v)
    if native and mom1.dtype == torch.int8 and g.device.type == "cpu":
        cpu_adam.fused_update_q8(item.w, rem, g, mom1, mom2, item.runs, hp.lr, hp.beta1, hp.beta2,
                                 hp.eps, hp.weight_decay, hp.step, hp.grad_scale, out=to)
        return
    if native and rem is not None and g.device.type == "cpu":
        for start, end, decay in item.runs:
            cpu_adam.fused_update(item.w[start:end], rem[start:end], g[start:end],
                                  mom1[start:end], mom2[start:end], hp.lr, hp.beta1,
                                  hp.beta2, hp.eps, hp.weight_decay if decay else 0.0, hp.step,
                                  hp.grad_scale, out=[t[start:end] for t in to])
        return
    if out is not None:  # the reference path updates in place: on a copy of the state
        if staged:
            raise ValueError(f"{item.name}: an update into another buffer needs its state in RAM")
        for src, dst in ((item.w, out.w), (rem, out.rem), (mom1, out.m), (mom2, out.v)):
            if src is not None:
                dst.copy_(src)
        item = _Fields(out, item.runs, item.numel)
        rem, mom1, mom2 = out.rem, out.m, out.v
    step = torch.tensor(float(hp.step), device=g.device)
    scale = None if hp.grad_scale == 1.0 else torch.tensor(1.0 / hp.grad_scale, device=g.device)
    if mom1.dtype == torch.int8:
        _update_int8(item, rem, mom1, mom2, g, hp, ws, step, scale)
        return
    exact_moments = mom1.dtype == torch.float32
    for start, end, decay in item.runs:
        for s in range(start, end, chunk):
            e, n = min(s + chunk, end), min(chunk, end - s)
            p = item.w[s:e] if rem is None else join_master(item.w[s:e], rem[s:e], ws.p[:n])
            m, v = (mom1[s:e], mom2[s:e]) if exact_moments else (
                ws.m[:n].copy_(mom1[s:e]), ws.v[:n].copy_(mom2[s:e]))
            torch._fused_adamw_([p], [g[s:e]], [m], [v], [], [step], lr=hp.lr,
                                beta1=hp.beta1, beta2=hp.beta2,
                                weight_decay=hp.weight_decay if decay else 0.0, eps=hp.eps,
                                amsgrad=False, maximize=False, grad_scale=scale)
            if rem is not None:
                split_master(p, item.w[s:e], rem[s:e])
            if not exact_moments:
                mom1[s:e].copy_(m)
                mom2[s:e].copy_(v)


def _update_int8(item, rem, mom1, mom2, g, hp: AdamHyper, ws: AdamWorkspace, step, scale) -> None:
    """adam_update's reference with 8-bit moments (slideformer.engine.runtime.moments8): chunks
    of whole blocks (QCHUNK at most: the requantise's temporaries), each dequantised into the
    workspace, updated run by run, requantised."""
    chunk = min(ws.p.numel(), QCHUNK) // QBLOCK * QBLOCK
    for s in range(0, item.numel, chunk):
        e = min(s + chunk, item.numel)
        qm, qv = moments8.block_span(mom1, s, e), moments8.block_span(mom2, s, e)
        m = moments8.dequantise(qm, e - s, True, ws.m)  # (blocks x QBLOCK,) zeros past e
        v = moments8.dequantise(qv, e - s, False, ws.v)
        p = item.w[s:e] if rem is None else join_master(item.w[s:e], rem[s:e], ws.p[:e - s])
        for start, end, decay in item.runs:
            a, b = max(start, s) - s, min(end, e) - s
            if a < b:
                torch._fused_adamw_([p[a:b]], [g[s + a:s + b]], [m[a:b]], [v[a:b]], [], [step],
                                    lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
                                    weight_decay=hp.weight_decay if decay else 0.0, eps=hp.eps,
                                    amsgrad=False, maximize=False, grad_scale=scale)
        if rem is not None:
            split_master(p, item.w[s:e], rem[s:e])
        moments8.quantise(m, True, qm)
        moments8.quantise(v, False, qv)


class _Fields:
    """Another buffer set (w, rem, m, v) seen as an item, for adam_update's ``out``."""

    def __init__(self, out, runs, numel):
        self.w, self.rem, self.m, self.v, self.runs = out.w, out.rem, out.m, out.v, runs
        self.numel = numel
