"""8-bit block-wise AdamW moments (``optim.moments_dtype = "int8"``): the format, its code maps,
and the PyTorch reference of the compiled kernel's dequantise and requantise
(slideformer.engine.kernels.cpu_adam; the design note is docs/design/speed.md, section 8).

Format: a moment of n values is one ``torch.int8`` tensor of bytes, in blocks of QBLOCK = 256
values; a block is its 256 one-byte codes, then its fp32 scale (the largest magnitude in the
block), QBLOCK_BYTES = 260 bytes (slideformer.engine.runtime.shapes.moment_numel). A value is

    x = table[code] * scale

so 1.016 bytes a value: with the bf16 weight and its remainder, 6.03 bytes per parameter of
host state instead of 12. Zero bytes are zero moments, as a fresh allocation holds. The last
block's unused codes are 0. Blocks never straddle items, and an item is quantised as a whole:
the blocks start at its first value whatever its weight-decay runs.

Code maps (the "dynamic" data type of Dettmers et al., 8-bit Optimizers via Block-wise
Quantization, ICLR 2022, used by bitsandbytes and torchao's AdamW8bit, rebuilt here from its
description): below 1, decade j (j = 0 the lowest) holds 2^j values spaced linearly over
(top / 10, top], top = 10^(j + 1 - decades). Codes are dense near the block's maximum, where an
update's size is decided, and still reach 1e-6 or 1e-7 of it, where a linear map's smallest
step (1/127 of the maximum) would flush the values to zero.
- m (signed): byte = sign << 7 | magnitude code, 7 decades (0 and 127 magnitudes from 1e-6 to 1);
  a magnitude that rounds to 0 is stored as +0.
- v (non-negative): 8 decades (0 and 255 values from 1e-7 to 1). A v > 0 never rounds to 0: a
  zero second moment under a non-zero first one divides m by eps alone, the "zero-point
  problem" that Li et al. (Memory Efficient Optimizers with 4-bit States, NeurIPS 2023) show
  to wreck training; rounded up to 1e-7 of the block's maximum it only shortens that step.
Encoding rounds to the nearest code (ties down): the code is the count of midpoints below
|x| / scale, found with one comparison in a bucket of the float's top bits (:func:`encode`).
The C kernel does the same against the same float32 tables (:data:`TABLES`, :data:`BUCKETS`):
given the same fp32 moments both paths store the same bytes.
"""
from __future__ import annotations

import torch

from slideformer.engine.runtime.shapes import QBLOCK, QBLOCK_BYTES


def _magnitudes(decades: int) -> list[float]:
    """0, then ``decades`` decades below 1 with 1, 2, 4, ... values: 2^decades values."""
    out = [0.0]
    for j in range(decades):
        top = 10.0 ** (j + 1 - decades)
        out += [top * (0.1 + 0.9 * i / 2 ** j) for i in range(1, 2 ** j + 1)]
    return out


def _midpoints(mag: list[float], zero_only: bool) -> list[float]:
    """Midpoints between neighbouring magnitudes, +inf last (a power-of-two table for the C
    search); ``zero_only``: the first is 0, so only 0 encodes to 0."""
    mid = [(a + b) / 2 for a, b in zip(mag, mag[1:])] + [float("inf")]
    if zero_only:
        mid[0] = 0.0
    return mid


_M_MAG, _V_MAG = _magnitudes(7), _magnitudes(8)  # 128, 256 entries
TABLES = torch.tensor(_M_MAG + _midpoints(_M_MAG, False) + _V_MAG + _midpoints(_V_MAG, True),
                      dtype=torch.float32)
"""m magnitudes (128), m midpoints (128), v values (256), v midpoints (256), as the C kernel
reads them."""
BUCKET_SHIFT, BUCKET_BASE = 15, 103 << 8
"""The C kernel's encoder (cpu_adam.c, the same constants): a float y in [2^-24, 2) falls in bucket
(bits(y) >> 15) - BUCKET_BASE (its exponent and 8 mantissa bits, 256 buckets an octave);
bucket 0 takes everything below."""


def _bucket_starts(mid: torch.Tensor) -> torch.Tensor:
    """The number of midpoints below each bucket; checks that no bucket holds two (the codes are
    at least 0.7% apart, a bucket at most 0.4% wide), so that one comparison finds the code."""
    lo = ((torch.arange(1, (128 << 8) - BUCKET_BASE, dtype=torch.int32) + BUCKET_BASE)
          << BUCKET_SHIFT).view(torch.float32)
    start = torch.searchsorted(mid, torch.cat([torch.zeros(1), lo, torch.full((1,), 2.0)]))
    assert (start.diff() <= 1).all(), "a bucket of the 8-bit moment encoder holds two midpoints"
    return start[:-1].to(torch.int32)


BUCKETS = torch.stack([_bucket_starts(TABLES[128:256]), _bucket_starts(TABLES[512:])])
"""(2, 6400) int32 (the C encoder gathers 32-bit words): the first code of each bucket, m then v."""
_M_LUT = torch.cat([TABLES[:128], -TABLES[:128]])
"""The value of each m byte (sign << 7 | magnitude)."""
_device_tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _tables(device: torch.device, signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(value of each byte, midpoints, bucket starts) of m (``signed``) or v, on ``device``."""
    if device not in _device_tables:
        _device_tables[device] = tuple(t.to(device) for t in (
            _M_LUT, TABLES[128:256], BUCKETS[0], TABLES[256:512], TABLES[512:], BUCKETS[1]))
    t = _device_tables[device]
    return t[:3] if signed else t[3:]


def blocks(n: int) -> int:
    """Blocks holding ``n`` values."""
    return -(-n // QBLOCK)


def block_span(q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The bytes of values [lo, hi) of the moment ``q``: lo on a block boundary, hi on one or at
    the moment's end."""
    if lo % QBLOCK:
        raise ValueError(f"8-bit moments split at {lo}, inside a block of {QBLOCK} values")
    return q[lo // QBLOCK * QBLOCK_BYTES:blocks(hi) * QBLOCK_BYTES]


def _split(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as uint8 (k, QBLOCK), scales (k, 1)) of whole blocks ``q``."""
    b = q.view(-1, QBLOCK_BYTES)
    return b[:, :QBLOCK].view(torch.uint8), b[:, QBLOCK:].view(torch.float32)


def dequantise(q: torch.Tensor, n: int, signed: bool, out: torch.Tensor) -> torch.Tensor:
    """fp32 values of the blocks ``q`` (holding ``n`` values) into ``out``: its first
    blocks(n) * QBLOCK elements, the n values then zeros for the rest of the last block."""
    codes, scale = _split(q)
    lut = _tables(q.device, signed)[0]
    x = out[:codes.numel()]
    torch.index_select(lut, 0, codes.reshape(-1).to(torch.int32), out=x)
    x.view_as(codes).mul_(scale)
    x[n:].zero_()
    return x


def encode(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """The nearest code (int32) of each y in [0, 1] of a contiguous tensor, as the C kernel
    finds it: the bucket of y's top bits, then one comparison with the midpoint after the
    bucket's start. Equal to ``torch.searchsorted(midpoints, y)`` (tests/engine/runtime/
    test_moments_int8.py), which is 5x slower on the CPU."""
    _, mid, start = _tables(y.device, signed)
    b = (y.view(torch.int32) >> BUCKET_SHIFT).sub_(BUCKET_BASE).clamp_(0, start.numel() - 1)
    c = start.index_select(0, b.view(-1)).view_as(y)
    after = torch.index_select(mid, 0, c.view(-1), out=b.view(torch.float32).view(-1))  # b's room
    return c.add_(after.view_as(y) < y)


def quantise(x: torch.Tensor, signed: bool, q: torch.Tensor) -> None:
    """Store ``x`` (fp32, whole blocks, zeros past the last value) as the blocks ``q``; ``x`` is
    overwritten (it is the update's scratch). Temporaries: 14 bytes a value (shapes.QCHUNK_TEMP)."""
    codes, scale = _split(q)
    xb = x.view_as(codes)  # (k, QBLOCK)
    amax = torch.maximum(xb.amax(1), xb.amin(1).neg()) if signed else xb.amax(1)
    scale.copy_(amax[:, None])
    xb.mul_(torch.where(amax > 0, amax.reciprocal(), 0.0)[:, None])
    if signed:
        neg = xb < 0
        c = encode(xb.abs_(), True)
        c.add_(neg.logical_and_(c > 0), alpha=128)  # the sign bit, but on no zero
    else:
        c = encode(xb, False)
    codes.copy_(c)
