"""NF4 dequantisation in one Triton kernel (``runtime.nf4.Nf4Layout.dequantize`` on the GPU).

The PyTorch form (a pair-table gather per code byte, the fp32 products, then a copy into the
compute dtype, in chunks of 4M weights) moves about 26 bytes an element through memory and
launches four kernels per chunk: on an H100 a GPT-OSS-120B layer (3.2 G weights) took tens of
milliseconds to dequantise, twice a step for each of 36 layers. Here a program reads its code
bytes and their absmax codes once and writes the weights: 0.5 + 1/64 + 2 bytes an element.

The same rounding as the PyTorch form, element for element: the block's absmax is
``DYNAMIC[qabs] * absmax2 + offset`` in fp32, rounded after the product and again after the sum
(the kernel is compiled without fused multiply-adds), the weight ``NF4[code] * absmax`` in fp32,
rounded once to the output dtype (to nearest even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slideformer.engine.kernels.dispatch import count_launch

BYTES = 1024
"""Code bytes (2048 weights, 32 blocks of 64) per program. Bound by memory bandwidth; picked,
not tuned."""


@triton.jit
def _dequant_nf4(codes_ptr, qabs_ptr, scales_ptr, nf4_ptr, dyn_ptr, out_ptr, n_bytes, n_weights,
                 n_scales,
                 BLOCK: tl.constexpr, BLOCK2: tl.constexpr, BYTES: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    m = i < n_bytes
    code = tl.load(codes_ptr + i, mask=m, other=0).to(tl.int32)
    blk = i // (BLOCK // 2)  # the block of 64 weights this byte's two weights belong to
    q = tl.load(qabs_ptr + blk, mask=m, other=0).to(tl.int32)
    s2 = tl.load(scales_ptr + blk // BLOCK2, mask=m, other=0.0)
    offset = tl.load(scales_ptr + n_scales)  # the tensor's mean absmax, after its scales
    absmax = tl.load(dyn_ptr + q) * s2 + offset
    hi = tl.load(nf4_ptr + (code >> 4)) * absmax  # the first weight sits in the high nibble
    lo = tl.load(nf4_ptr + (code & 15)) * absmax
    w = tl.reshape(tl.join(hi, lo), [2 * BYTES])
    j = tl.program_id(0).to(tl.int64) * (2 * BYTES) + tl.arange(0, 2 * BYTES)
    tl.store(out_ptr + j, w.to(out_ptr.dtype.element_ty), mask=j < n_weights)


_TABLES: dict = {}


def _tables(device, nf4: torch.Tensor, dynamic: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = (nf4.to(device), dynamic.to(device))
    return _TABLES[key]


def dequantize_nf4(codes: torch.Tensor, qabs: torch.Tensor, scales: torch.Tensor,
                   out: torch.Tensor, nf4: torch.Tensor, dynamic: torch.Tensor,
                   block: int, block2: int) -> None:
    """Fill ``out`` (contiguous, 2 x codes.numel() weights) from one NF4 matrix's ``codes``
    (uint8), absmax codes ``qabs`` (uint8) and ``scales`` (fp32: the second-level scales, then
    the offset): ``Nf4Layout.parts``' views."""
    n = codes.numel()
    t_nf4, t_dyn = _tables(codes.device, nf4, dynamic)
    count_launch("triton_nf4_dequant")
    # the weight count is its own argument: 2 * n_bytes in the kernel would be an int32 product
    # (Triton passes a count under 2^31 as int32) and wrap for matrices of 2^31 weights or more
    _dequant_nf4[(triton.cdiv(n, BYTES),)](codes, qabs, scales, t_nf4, t_dyn, out, n, 2 * n,
                                           scales.numel() - 1, BLOCK=block, BLOCK2=block2,
                                           BYTES=BYTES, num_warps=4, enable_fp_fusion=False)
