"""A GGUF file's metadata and tensor table, read without its tensors or its vocabulary, and
checked: every structural way a GGUF file can be cut short or lie is one :class:`UserError`.

``gguf.GGUFReader`` turns every token of the vocabulary into a numpy view: 3.3 s for
SmolLM2-135M's 49K tokens and 49K merges here. Listing the models of a machine needs only the
architecture figures and the tensor table, so :func:`read_header` walks the file's header with
``struct`` and skips the contents of long arrays (20 ms for the same file). A :class:`GGUFHeader`
answers ``get``, ``shape``, ``tensors`` and ``check_types`` as
:class:`~slideformer.engine.gguf.reader.GGUFFile` does, so the importer's checks run on it
unchanged; the reader runs :func:`read_header` before ``gguf.GGUFReader`` sees the file, which
trusts its length fields (an array claiming 2**62 bytes made it loop past the end of the file,
growing its lists).

Layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version (u32), tensor count (u64),
key-value count (u64); each key-value: key (string), type (u32), value; each tensor: name
(string), dimension count (u32), dimensions innermost first (u64 each), type (u32), offset of its
data (u64) from the data section, which starts at the next multiple of ``general.alignment``
(default 32). A string is its byte length (u64) and its UTF-8 bytes.

The checks are llama.cpp's (``gguf_init_from_file``): keys and tensor names unique, at most 4
dimensions, a known tensor type whose block divides the rows, ``general.alignment`` a u32 power
of two, and each tensor's data right after the previous one's, padded to the alignment (so no
data overlaps, none is misaligned, and none lies past the end of the file).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from slideformer.engine.errors import UserError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value type -> its struct format (8 is a string, 9 an array)."""
STRING, ARRAY, U32 = 8, 9, 4
_MIN_BYTES = {t: struct.calcsize(f) for t, f in _SCALARS.items()} | {STRING: 8, ARRAY: 12}
"""The fewest bytes a value of each type takes (an empty string or array: its length fields)."""
LONG_ARRAY = 1024
"""Arrays longer than this (a vocabulary, its merges and token types) are skipped, not read."""
MAX_DIMS = 4
"""GGML_MAX_DIMS: llama.cpp refuses tensors of more dimensions."""
MAX_NESTING = 8
"""Arrays of arrays nested deeper than this are refused (recursion, not a real model's)."""
_KV_BYTES, _TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8
"""The fewest bytes one key-value (an empty key, a u8) and one tensor info (no name, no
dimension) take: a count that the rest of the file cannot hold is refused before any loop."""
_FIX = ("download the file again, or convert the model again: this is not a complete, valid "
        "GGUF file")


class BadGGUF(ValueError):
    """What is wrong with the file's structure (:func:`read_header` names the file)."""


@dataclass(frozen=True)
class Unread:
    """A long array's place in :attr:`GGUFHeader.meta`: its length and element type, not its
    contents."""
    length: int
    etype: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: GGUF's dimension order (innermost first) and type, as
    ``gguf.ReaderTensor`` has them."""
    shape: tuple[int, ...]
    tensor_type: gguf.GGMLQuantizationType
    offset: int
    """Where its data starts, from the start of the data section."""

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements // block * size


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (key -> value; long arrays :class:`Unread`) and tensor table of a GGUF file."""
    path: Path
    meta: dict
    tensors: dict[str, TensorInfo]

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch order."""
        return tuple(reversed(self.tensors[name].shape))

    def check_types(self) -> None:
        check_types(self.path, (t.tensor_type for t in self.tensors.values()))


def _probe(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether the ``gguf`` package can dequantise ``qtype`` (tried on one zero block)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_types(path: Path, types) -> None:
    """Every tensor type in ``types`` can be dequantised, or one message naming those that
    cannot (each type is probed once)."""
    bad = sorted(q.name for q in set(types) if not _probe(q))
    if bad:
        raise UserError(path, f"holds tensors of type {', '.join(bad)}, which the "
                              f"gguf package cannot dequantise",
                        "use a GGUF of type F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                        "Q2_K..Q6_K or an IQ type")


class _Cursor:
    """Reads little-endian values from a buffer, front to back; every read past its end, and
    every length or count the rest of the buffer cannot hold, is a :class:`BadGGUF`."""

    def __init__(self, buf, at: int):
        self.buf, self.at = buf, at

    def take(self, fmt: str, what: str):
        try:
            value = struct.unpack_from(fmt, self.buf, self.at)[0]
        except struct.error:
            raise BadGGUF(f"it ends inside {what}: cut short") from None
        self.at += struct.calcsize(fmt)
        return value

    def room(self, n: int, item_bytes: int, what: str, unit: str = "items") -> None:
        """``n`` items of at least ``item_bytes`` each fit in the rest of the buffer (checked
        before any loop over them or any allocation for them)."""
        left = len(self.buf) - self.at
        if n * item_bytes > left:
            raise BadGGUF(f"{what} claims {n:,} {unit}; the {left:,} bytes left in the file "
                          "cannot hold them: cut short, or a length that lies")

    def string(self, what: str) -> str:
        n = self.take("<Q", what)
        self.room(n, 1, what, "bytes")
        raw = bytes(self.buf[self.at:self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadGGUF(f"{what} is not UTF-8 text") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            return self.array(what, depth)
        if vtype not in _SCALARS:
            raise BadGGUF(f"{what} has the unknown value type {vtype}")
        return self.take(_SCALARS[vtype], what)

    def array(self, what: str, depth: int):
        etype, n = self.take("<I", what), self.take("<Q", what)
        if etype not in _MIN_BYTES:
            raise BadGGUF(f"{what} is an array of the unknown value type {etype}")
        if etype == ARRAY and depth >= MAX_NESTING:
            raise BadGGUF(f"{what} nests arrays more than {MAX_NESTING} deep")
        self.room(n, _MIN_BYTES[etype], what)
        if n > LONG_ARRAY:
            self.skip(etype, n, what, depth)
            return Unread(n, etype)
        return [self.value(etype, what, depth + 1) for _ in range(n)]

    def skip(self, etype: int, n: int, what: str, depth: int) -> None:
        if etype in _SCALARS:
            self.at += _MIN_BYTES[etype] * n
        elif etype == STRING:
            length, buf, at = struct.Struct("<Q").unpack_from, self.buf, self.at
            try:
                for _ in range(n):  # the hot loop of a vocabulary: no method calls
                    at += 8 + length(buf, at)[0]
            except struct.error:
                raise BadGGUF(f"{what} runs past the end of the file: cut short") from None
            self.at = at
        else:
            for _ in range(n):
                self.value(etype, what, depth + 1)
        if self.at > len(self.buf):
            raise BadGGUF(f"{what} runs past the end of the file: cut short")


def read_header(path: Path | str) -> GGUFHeader:
    """The header of the GGUF file ``path``; one :class:`UserError` per way it is unreadable
    (not GGUF, another version, cut short, or lying about its own layout)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                raise BadGGUF("it is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path)
    except BadGGUF as e:
        raise UserError(path, f"cannot be read as GGUF ({e})", _FIX) from None
    except OSError as e:
        raise UserError(path, f"cannot be read ({e.strerror or e})",
                        "check that the file is there and that you may read it") from None


def _parse(buf, path: Path) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise BadGGUF("it does not start with the GGUF magic")
    c = _Cursor(buf, 4)
    _check_version(c.take("<I", "the version"))
    n_tensors, n_kv = c.take("<Q", "the tensor count"), c.take("<Q", "the key-value count")
    c.room(n_kv, _KV_BYTES, "the key-value count")
    meta = _read_meta(c, n_kv)
    c.room(n_tensors, _TENSOR_BYTES, "the tensor count")
    tensors = {}
    for i in range(n_tensors):
        name, info = _read_tensor(c, i)
        if name in tensors:
            raise BadGGUF(f"two tensors are named '{name}'")
        tensors[name] = info
    align = meta.get("general.alignment", 32)
    _check_data(tensors, -(-c.at // align) * align, len(buf), align)
    return GGUFHeader(path, meta, tensors)


def _check_version(version: int) -> None:
    if version in (2, 3):
        return
    if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
        raise BadGGUF("it is a big-endian GGUF file; little-endian files are read")
    raise BadGGUF(f"it is GGUF version {version}; versions 2 and 3 are read")


def _read_meta(c: _Cursor, n_kv: int) -> dict:
    meta = {}
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}")
        if key in meta:
            raise BadGGUF(f"the metadata key '{key}' appears twice")
        vtype = c.take("<I", f"metadata '{key}'")
        meta[key] = c.value(vtype, f"metadata '{key}'")
        if key == "general.alignment":
            a = meta[key]
            if vtype != U32 or a <= 0 or a & (a - 1):
                raise BadGGUF(f"general.alignment is {a!r} (type {vtype}), not a u32 power of "
                              "two")
    return meta


def _read_tensor(c: _Cursor, i: int) -> tuple[str, TensorInfo]:
    name = c.string(f"the name of tensor #{i}")
    what = f"tensor '{name}'"
    n_dims = c.take("<I", what)
    if n_dims > MAX_DIMS:
        raise BadGGUF(f"{what} has {n_dims:,} dimensions; GGUF allows at most {MAX_DIMS}")
    dims = tuple(c.take("<Q", what) for _ in range(n_dims))
    raw_type = c.take("<I", what)
    offset = c.take("<Q", what)
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise BadGGUF(f"{what} has the unknown tensor type {raw_type}") from None
    info = TensorInfo(dims, qtype, offset)
    if any(d >= 2**63 for d in dims) or info.n_elements >= 2**63:
        raise BadGGUF(f"{what} has the shape {list(dims)}, more elements than GGUF can address")
    if dims and dims[0] % block:
        raise BadGGUF(f"{what} of type {qtype.name} has rows of {dims[0]} values, not a "
                      f"multiple of its block of {block}")
    return name, info


def _check_data(tensors: dict[str, TensorInfo], start: int, size: int, align: int) -> None:
    """Each tensor's data follows the previous one's, padded to ``align``, and the last one ends
    where the file does (less its padding).

    llama.cpp checks the first and that the data fits; the second catches a header that lies
    about where the data starts (a tensor count one short, another alignment): the data is
    then read from the wrong place and the bytes past the last tensor are left over. Writers
    (llama.cpp's, the gguf package's) pad after every tensor, the last one too.
    """
    expected = end = 0
    for name, t in tensors.items():
        if t.offset != expected:
            raise BadGGUF(f"tensor '{name}' has its data at offset {t.offset:,}; after the "
                          f"tensors before it, it must start at {expected:,} (each tensor's "
                          f"data follows the previous one's, aligned to {align} bytes)")
        end = start + t.offset + t.n_bytes
        if end > size:
            raise BadGGUF(f"tensor '{name}' needs the file to hold {end:,} bytes, it has "
                          f"{size:,}: cut short")
        expected += -(-t.n_bytes // align) * align
    if tensors and size - end >= align:
        raise BadGGUF(f"its tensors end at byte {end:,} but the file goes on to {size:,}: its "
                      "header does not describe its data")
