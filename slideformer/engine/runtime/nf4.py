"""4-bit NormalFloat (NF4) weights with double-quantised scales (QLoRA, Dettmers et al. 2023).

The format is bitsandbytes' (``quantize_4bit(quant_type="nf4", blocksize=64,
compress_statistics=True)``), so our quantised weights and the ``*-bnb-4bit`` checkpoints are
the same bytes:
  codes    two 4-bit indices into :data:`NF4` per byte, the first element in the high nibble
  absmax   per block of 64 weights, its largest magnitude, itself quantised (double
           quantisation): ``absmax = DYNAMIC[qabs] * absmax2[block of 256] + offset`` with
           ``offset`` the mean absmax of the tensor and DYNAMIC the signed 8-bit dynamic map
  weight   ``NF4[code] * absmax`` computed in fp32, rounded once to the compute dtype
Per parameter: 0.5 B of codes + 1/64 B of absmax codes + 4/16384 B of second-level scales.

The implementation is PyTorch ops (CPU and GPU alike, no extra dependency); on the GPU the
dequantisation, run twice a step for every layer, is one Triton kernel
(``kernels.triton_nf4``, element for element the PyTorch form's values) where triton is
there and ``SLIDEFORMER_TRITON`` is not ``0``. bitsandbytes is the reference in the tests.

A layer is one flat uint8 buffer (:class:`Nf4Layout`): the quantised matrices, then the 1-D
tensors (norms, biases) unquantised in the compute dtype, so it crosses PCIe as one copy and
sits in one parameter slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slideformer.engine.kernels import dispatch
from slideformer.engine.models.spec import Layout

BLOCK = 64
"""Weights per absmax (bitsandbytes' default for NF4)."""
BLOCK2 = 256
"""absmax values per second-level scale."""
CHUNK = 1 << 22
"""Weights per piece of a (de)quantisation: bounds the fp32/int64 temporaries to ~50 MB."""

# The NF4 data type as published (QLoRA, appendix E): quantiles of N(0, 1) scaled to [-1, 1],
# with an exact zero.
NF4 = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic map (Dettmers 2016, arXiv:1511.04561) used for the scales.

    A value is sign x 10^-e x fraction: exponent e = 6 .. 0 is encoded by leading zeros, and the
    bits left after them hold a linear fraction in (0.1, 1): 2^(6-e) midpoints per exponent
    and sign; plus 0 and 1, padded with zeros to 256 entries, sorted.
    """
    vals = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        vals += mids + [-m for m in mids]
    vals += [0.0] * (256 - len(vals))
    return torch.tensor(sorted(vals), dtype=torch.float32)


DYNAMIC = dynamic_map()


def _nearest(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted ``table`` for each element of x (int64)."""
    mids = (table[1:] + table[:-1]) / 2
    return torch.bucketize(x, mids.to(x.device), right=True)


def _quantize_blocks(x: torch.Tensor, table: torch.Tensor, block: int):
    """(indices, absmax): x (n,) in blocks of ``block``, each scaled by its largest magnitude."""
    blocks = x.view(-1, block)
    absmax = blocks.abs().amax(dim=1)  # (n / block,)
    scaled = blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]
    return _nearest(scaled.reshape(-1), table), absmax


@dataclass(frozen=True)
class Nf4Tensor:
    """One matrix's place in a quantised layer buffer (byte offsets)."""
    name: str
    shape: tuple[int, ...]
    numel: int
    codes: int
    """Offset of the packed codes (numel / 2 bytes)."""
    qabs: int
    """Offset of the absmax codes (numel / 64 bytes)."""
    scales: int
    """Offset of the second-level scales and the offset (fp32: blocks2 + 1 values)."""

    @property
    def blocks(self) -> int:
        return self.numel // BLOCK

    @property
    def blocks2(self) -> int:
        return math.ceil(self.blocks / BLOCK2)


@dataclass(frozen=True)
class Nf4Layout:
    """Byte layout of one quantised item: NF4 matrices, then the 1-D tensors in ``dtype``."""
    layout: Layout
    """The item's unquantised layout (what :meth:`dequantize` fills)."""
    dtype: torch.dtype
    tensors: tuple[Nf4Tensor, ...]
    raw: tuple[tuple[str, int], ...]
    """(name, byte offset) of the unquantised 1-D tensors."""
    nbytes: int

    @staticmethod
    def build(layout: Layout, dtype: torch.dtype) -> "Nf4Layout":
        mats = [(n, s) for n, _, s in layout.entries if _quantised(n, s)]
        off, tensors = 0, []
        for name, shape in mats:
            numel = math.prod(shape)
            if numel % BLOCK:
                raise ValueError(f"{name}: {numel} weights is not a multiple of {BLOCK}")
            codes, qabs = off, off + numel // 2
            scales = _align(qabs + numel // BLOCK, 4)
            t = Nf4Tensor(name, tuple(shape), numel, codes, qabs, scales)
            off = scales + 4 * (t.blocks2 + 1)
            tensors.append(t)
        size = torch.empty((), dtype=dtype).element_size()
        raw = []
        for name, _, shape in layout.entries:
            if not _quantised(name, shape):
                off = _align(off, size)
                raw.append((name, off))
                off += math.prod(shape) * size
        return Nf4Layout(layout, dtype, tuple(tensors), tuple(raw), _align(off, 16))

    # ---- quantise (host, while loading) ----------------------------------------------------
    def quantize(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Quantise an item's weights (fp32, ``layout``) into ``out`` (uint8, ``nbytes``)."""
        views = self.layout.views(flat)
        for t in self.tensors:
            self.quantize_tensor(t, views[t.name], out)
        for name, off in self.raw:
            v = views[name]
            self.raw_view(out, off, v.numel()).copy_(v.reshape(-1))
        return out

    def quantize_tensor(self, t: Nf4Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """Quantise one matrix ``w`` (any float dtype, ``t.shape``) into its place in ``out``."""
        codes, qabs, scales = self.parts(out, t)
        absmax = torch.empty(t.blocks, dtype=torch.float32, device=w.device)
        w = w.reshape(-1)
        for s in range(0, t.numel, CHUNK):
            e = min(s + CHUNK, t.numel)
            idx, absmax[s // BLOCK:e // BLOCK] = _quantize_blocks(w[s:e].float(), NF4, BLOCK)
            pairs = idx.view(-1, 2)
            codes[s // 2:e // 2] = (pairs[:, 0] * 16 + pairs[:, 1]).to(torch.uint8)
        offset = absmax.mean()
        centred = torch.zeros(t.blocks2 * BLOCK2, dtype=torch.float32, device=w.device)
        centred[:t.blocks] = absmax - offset
        idx2, absmax2 = _quantize_blocks(centred, DYNAMIC, BLOCK2)
        qabs.copy_(idx2[:t.blocks].to(torch.uint8))
        scales[:-1] = absmax2
        scales[-1] = offset

    # ---- dequantise (device, per use) ------------------------------------------------------
    def dequantize(self, buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Weights of a quantised item ``buf`` (uint8) into ``out`` (``dtype``, layout numel)."""
        views = self.layout.views(out)
        fused = dispatch.fused_ops_on(buf.device.type)  # kernels.triton_nf4: the same values
        for t in self.tensors:
            codes, qabs, scales = self.parts(buf, t)
            dst = views[t.name].view(-1)
            if fused:
                from slideformer.engine.kernels.triton_nf4 import dequantize_nf4
                dequantize_nf4(codes, qabs, scales, dst, NF4, DYNAMIC, BLOCK, BLOCK2)
                continue
            absmax = self._absmax(t, qabs, scales)
            pair_table = _tables(buf.device)[0]
            for s in range(0, t.numel, CHUNK):
                e = min(s + CHUNK, t.numel)
                vals = pair_table[codes[s // 2:e // 2].long()].view(-1, BLOCK)  # (blocks, 64) fp32
                dst[s:e].view(-1, BLOCK).copy_(vals * absmax[s // BLOCK:e // BLOCK, None])
        for name, off in self.raw:
            v = views[name]
            v.copy_(self.raw_view(buf, off, v.numel()).view(v.shape))
        return out

    def _absmax(self, t: Nf4Tensor, qabs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The fp32 absmax of each block of 64 from its codes and the second-level scales."""
        a = _tables(qabs.device)[1][qabs.long()]  # (blocks,)
        a2 = scales[:-1].repeat_interleave(BLOCK2)[:t.blocks]
        return a * a2 + scales[-1]

    def parts(self, buf: torch.Tensor, t: Nf4Tensor):
        """(codes, absmax codes, fp32 second-level scales then the offset): views into ``buf``."""
        codes = buf[t.codes:t.codes + t.numel // 2]
        qabs = buf[t.qabs:t.qabs + t.blocks]
        scales = buf[t.scales:t.scales + 4 * (t.blocks2 + 1)].view(torch.float32)
        return codes, qabs, scales

    def raw_view(self, buf: torch.Tensor, off: int, numel: int) -> torch.Tensor:
        """The unquantised 1-D tensor of ``numel`` values at byte ``off`` of ``buf``."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return buf[off:off + numel * size].view(self.dtype)


_TABLES: dict = {}


def _tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantisation tables on ``device``, copied there once: a per-use copy from pageable
    host memory would make the host wait for the compute stream at every layer.

    (256, 2) fp32: the two NF4 values a code byte holds (high nibble first); DYNAMIC.
    """
    key = str(device)
    if key not in _TABLES:
        b = torch.arange(256)
        pairs = torch.stack([NF4[b // 16], NF4[b % 16]], dim=1)
        _TABLES[key] = (pairs.to(device), DYNAMIC.to(device))
    return _TABLES[key]


def _quantised(name: str, shape: tuple[int, ...]) -> bool:
    """Which of an item's tensors are stored in NF4: the weight matrices (stacked experts too),
    not the vectors, nor biases of any shape (GPT-OSS's experts stack theirs as (E, out)), as
    bitsandbytes quantises a Linear's weight and keeps its bias; nor a convolution's taps
    (Qwen3.5's ``conv1d``, not a Linear), nor a matrix of fewer than a block's weights per
    row (Qwen3.5-MoE's (1, H) shared-expert gate): those stay in the compute dtype."""
    return (len(shape) > 1 and not name.endswith("bias") and "conv1d" not in name
            and math.prod(shape) % BLOCK == 0 and shape[0] > 1)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a
