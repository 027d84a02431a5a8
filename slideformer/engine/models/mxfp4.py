"""MXFP4 expert weights (the GPT-OSS releases), dequantised as they are read.

OCP Microscaling FP4: blocks of 32 values share one power-of-two scale. A tensor ``W`` of the
checkpoint is stored as two tensors:

    W_blocks  (E, out, G, 16) uint8   two E2M1 codes a byte, the low nibble first
    W_scales  (E, out, G)     uint8   the block's exponent + 127 (E8M0)

    W[e, o, 32 g + j] = E2M1[code j of block (e, o, g)] * 2 ** (scale[e, o, g] - 127)

with E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives (code bit 3 is the sign). GPT-OSS
stores the experts (E, out, in) this way and computes with (E, in, out): the dequantised
tensor is transposed. The values are exact in bf16 and fp32 (a 2-bit mantissa times a power of
two) for any scale within bf16's exponent range; one expert is expanded at a time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
"""Values a scale covers (16 bytes of codes)."""
DESCRIPTION = "MXFP4 experts (dequantised on load)"


def parts(name: str) -> tuple[str, str]:
    """The checkpoint names of a tensor stored in MXFP4: (blocks, scales)."""
    return name + "_blocks", name + "_scales"


def is_mxfp4(meta: dict, name: str) -> bool:
    """Whether the checkpoint stores ``name`` (absent itself) as MXFP4 blocks and scales."""
    return name not in meta and all(p in meta for p in parts(name))


def stored_shape(meta: dict, name: str) -> tuple[int, ...] | None:
    """The (E, in, out) shape an MXFP4 tensor dequantises to, or None when its two parts do not
    fit together (dtypes other than U8, another rank, a block of other than 16 bytes, scales
    of another shape)."""
    blocks, scales = (meta[p] for p in parts(name))
    b, s = tuple(blocks["shape"]), tuple(scales["shape"])
    if blocks["dtype"] != "U8" or scales["dtype"] != "U8" or len(b) != 4 or b[-1] != BLOCK // 2 \
            or b[:-1] != s:
        return None
    return b[0], b[2] * BLOCK, b[1]


def dequantize(blocks: "torch.Tensor", scales: "torch.Tensor", out: "torch.Tensor") -> "torch.Tensor":
    """Fill ``out`` (E, in, out) with the values of ``blocks`` (E, out, G, 16) and ``scales``
    (E, out, G), one expert at a time (the transient is one expert in ``out``'s dtype)."""
    import torch

    lut = torch.tensor(E2M1, dtype=torch.float32)
    for e in range(blocks.shape[0]):
        b = blocks[e].to(torch.uint8)  # (out, G, 16)
        vals = torch.empty(*b.shape[:-1], BLOCK, dtype=torch.float32)  # (out, G, 32)
        vals[..., 0::2], vals[..., 1::2] = lut[(b & 0x0F).long()], lut[(b >> 4).long()]
        vals = torch.ldexp(vals, scales[e].to(torch.int32)[..., None] - 127)
        out[e].copy_(vals.reshape(b.shape[0], -1).t())  # (in, out)
    return out
