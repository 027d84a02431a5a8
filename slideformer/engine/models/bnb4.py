"""Pre-quantised bitsandbytes 4-bit weights: the ``*-bnb-4bit`` model folders.

transformers' ``save_pretrained`` of a model loaded with ``BitsAndBytesConfig(load_in_4bit=True)``
writes every quantised linear weight ``W`` as bitsandbytes' ``Linear4bit._save_to_state_dict``
does: the packed weight, then ``QuantState.as_dict(packed=True)`` under the prefix ``W.``:

  W                                  the 4-bit codes, two per byte: uint8 (numel / 2, 1), or
                                     the same bytes viewed as bnb_4bit_quant_storage's dtype
  W.absmax                           per block of 64 weights, its absmax code (uint8)
  W.nested_absmax                    per 256 absmax codes, the second-level scale (fp32)
  W.quant_map                        the 16 values of NF4 (fp32)
  W.nested_quant_map                 the 256 values of the signed dynamic map (fp32)
  W.quant_state.bitsandbytes__nf4    a JSON object as uint8: quant_type, blocksize, dtype, shape,
                                     nested_blocksize, nested_dtype, nested_offset

The embeddings, the LM head and the 1-D tensors stay bf16 or fp16 and are read like any float
tensor. With quant_type nf4, blocksize 64 and double quantisation in blocks of 256 (QLoRA's
recipe, and that of the *-bnb-4bit releases), these are the bytes of
:mod:`slideformer.engine.runtime.nf4`: qlora copies them into its layer buffers as stored, never
requantising; every other reader dequantises them with that module (bitsandbytes'
``dequantize_4bit`` is the tests' reference). Other variants are refused by name.

Checking a folder (:func:`check_weight`) reads headers and the small JSON blobs only, without
torch; the tables and scales are checked as they are read.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from slideformer.engine.errors import UserError

if TYPE_CHECKING:
    import torch

    from slideformer.engine.models.weights import Checkpoint
    from slideformer.engine.runtime.nf4 import Nf4Layout, Nf4Tensor

DESCRIPTION = "pre-quantised NF4 (bitsandbytes)"
"""How reports name the weights of such a folder."""
STATE = "quant_state.bitsandbytes__"
"""Prefix of the JSON blob's key; bitsandbytes appends the quant type (nf4 or fp4)."""
BLOCK, BLOCK2 = 64, 256
"""The block sizes whose bytes are ours (slideformer.engine.runtime.nf4.BLOCK, BLOCK2)."""
UNSUPPORTED_FIX = ("use a release quantised with bnb_4bit_quant_type=\"nf4\", "
                   "bnb_4bit_use_double_quant=True and the default blocksize 64 (as the "
                   "*-bnb-4bit releases are), or the unquantised release of the model")
DAMAGED_FIX = "the folder is incomplete or damaged: download or copy it again"


def is_quantised(meta: dict, name: str) -> bool:
    """Whether the checkpoint (header entries ``meta``) stores ``name`` as a 4-bit weight."""
    return any(f"{name}.{k}" in meta for k in ("absmax", STATE + "nf4", STATE + "fp4"))


def check_weight(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> dict:
    """Refuse a 4-bit weight whose format is not ours or whose parts are missing or misshapen.

    Returns:
        The weight's quant state (the JSON blob's object).
    """
    path = ckpt.where[name]
    if f"{name}.{STATE}fp4" in ckpt.meta:
        raise UserError(path, f"tensor '{name}' is quantised as FP4; only NF4 4-bit weights "
                        "are supported", UNSUPPORTED_FIX)
    state = _state(ckpt, name)
    if not isinstance(state, dict):
        raise UserError(ckpt.where[f"{name}.{STATE}nf4"], f"tensor '{name}.{STATE}nf4' "
                        "is not a quant state (a JSON object)", DAMAGED_FIX)
    unsupported = _unsupported(state)
    if unsupported:
        raise UserError(path, f"tensor '{name}' is NF4 {unsupported}; only blocks of "
                        f"{BLOCK} with double-quantised scales (blocks of {BLOCK2}) are supported",
                        UNSUPPORTED_FIX)
    if state.get("shape") != list(shape):
        raise UserError(path, f"tensor '{name}' has shape {state.get('shape')} (its quant "
                        f"state), config.json implies {list(shape)}",
                        "the weights do not match config.json; use the matching files")
    numel = math.prod(shape)
    if numel % BLOCK:
        raise UserError(path, f"tensor '{name}' has {numel:,} weights, not whole blocks of "
                        f"{BLOCK}", UNSUPPORTED_FIX)
    blocks = numel // BLOCK
    _check_part(ckpt, name, "", None, numel // 2)
    _check_part(ckpt, name, ".absmax", "U8", blocks)
    _check_part(ckpt, name, ".nested_absmax", "F32", math.ceil(blocks / BLOCK2))
    _check_part(ckpt, name, ".quant_map", "F32", 16)
    _check_part(ckpt, name, ".nested_quant_map", "F32", 256)
    return state


def _state(ckpt: Checkpoint, name: str):
    key = f"{name}.{STATE}nf4"
    if key not in ckpt.meta:
        raise UserError(ckpt.where[name], f"tensor '{key}' is missing: the 4-bit weight "
                        f"'{name}' cannot be read without it", DAMAGED_FIX)
    try:
        return json.loads(ckpt.raw_bytes(key).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise UserError(ckpt.where[key], f"tensor '{key}' is not a quant state (JSON text)",
                        DAMAGED_FIX) from None


def _unsupported(state: dict) -> str:
    """What in a quant state is not our format ('' when it is)."""
    if state.get("quant_type") != "nf4":
        return f"with quant_type {state.get('quant_type')!r}"
    if state.get("blocksize") != BLOCK:
        return f"in blocks of {state.get('blocksize')}"
    if "nested_offset" not in state:
        return "without double quantisation (bnb_4bit_use_double_quant=False)"
    if state.get("nested_blocksize") != BLOCK2 or state.get("nested_dtype") != "float32":
        return (f"with scales quantised in blocks of {state.get('nested_blocksize')} "
                f"({state.get('nested_dtype')})")
    if not isinstance(state["nested_offset"], (int, float)) or not math.isfinite(state["nested_offset"]):
        return f"with the scale offset {state['nested_offset']!r}"
    return ""


def _check_part(ckpt: Checkpoint, name: str, suffix: str, dtype: str | None, numel: int) -> None:
    """The part ``name + suffix`` exists as ``numel`` values of ``dtype`` (None: the packed
    codes, whose dtype is the quant storage's: only their byte count is fixed)."""
    key = name + suffix
    if key not in ckpt.meta:
        raise UserError(ckpt.where[name], f"tensor '{key}' is missing: the 4-bit weight "
                        f"'{name}' cannot be read without it", DAMAGED_FIX)
    meta = ckpt.meta[key]
    begin, end = meta["data_offsets"]
    n = math.prod(meta["shape"])
    if dtype is None and end - begin != numel:
        raise UserError(ckpt.where[key], f"tensor '{key}' holds {end - begin:,} bytes of 4-bit "
                        f"codes, its quant state implies {numel:,}", DAMAGED_FIX)
    if dtype is not None and (meta["dtype"] != dtype or n != numel):
        raise UserError(ckpt.where[key], f"tensor '{key}' is {meta['dtype']} {meta['shape']}, "
                        f"expected {dtype} [{numel}]", DAMAGED_FIX)


def copy_weight(ckpt: Checkpoint, name: str, shape: tuple[int, ...], quant: Nf4Layout,
                t: Nf4Tensor, buf: torch.Tensor) -> None:
    """Copy a 4-bit weight's codes and scales as stored into its place ``t`` in ``buf``."""
    import torch

    from slideformer.engine.runtime.nf4 import DYNAMIC, NF4

    state = check_weight(ckpt, name, shape)
    for suffix, table, what in ((".quant_map", NF4, "NF4"),
                                (".nested_quant_map", DYNAMIC, "the signed dynamic map")):
        if not torch.equal(ckpt.tensor(name + suffix), table):
            raise UserError(ckpt.where[name + suffix], f"tensor '{name}{suffix}' is not "
                            f"{what}, so '{name}' is not in the NF4 format", UNSUPPORTED_FIX)
    codes, qabs, scales = quant.parts(buf, t)
    # a quant storage other than uint8 (FSDP-QLoRA's bf16, say) holds the same bytes
    codes.copy_(ckpt.tensor(name).view(torch.uint8).reshape(-1))
    qabs.copy_(ckpt.tensor(name + ".absmax"))
    scales[:-1] = ckpt.tensor(name + ".nested_absmax")
    scales[-1] = float(state["nested_offset"])
    ckpt.check_finite(name + ".nested_absmax", scales[:-1])


def dequantize(ckpt: Checkpoint, name: str, out: torch.Tensor) -> torch.Tensor:
    """A 4-bit weight's values into ``out`` (its shape, any float dtype): NF4 x absmax in
    fp32, rounded once to ``out``'s dtype, as bitsandbytes' dequantize_4bit computes them."""
    import torch

    from slideformer.engine.models.spec import Layout
    from slideformer.engine.runtime.nf4 import Nf4Layout

    shape = tuple(out.shape)
    quant = Nf4Layout.build(Layout.build([(name, shape)]), torch.float32)
    buf = torch.empty(quant.nbytes, dtype=torch.uint8)
    copy_weight(ckpt, name, shape, quant, quant.tensors[0], buf)
    quant.dequantize(buf, out.view(-1))
    return out


def load_note(ckpt: Checkpoint, nf4: bool) -> str:
    """The log line that says what loading does with a folder of 4-bit weights."""
    how = ("copied as stored into the NF4 layers (no requantisation)" if nf4 else
           "dequantised while loading (NF4 x scale in fp32; train.method = \"qlora\" keeps "
           "them 4-bit)")
    return f"{ckpt.dir}: {DESCRIPTION} weights, {how}"
