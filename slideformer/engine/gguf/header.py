"""A GGUF file's metadata and tensor table, read without its tensors or its vocabulary.

``gguf.GGUFReader`` turns every token of the vocabulary into a numpy view: 3.3 s for
SmolLM2-135M's 49K tokens and 49K merges here. Listing the models of a machine needs only the
architecture figures and the tensor table, so :func:`read_header` walks the file's header with
``struct`` and skips the contents of long arrays (20 ms for the same file). A :class:`GGUFHeader`
answers ``get``, ``shape``, ``tensors`` and ``check_types`` as :class:`~slideformer.engine.gguf.reader.GGUFFile`
does, so the importer's checks run on it unchanged.

Layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version (u32), tensor count (u64),
key-value count (u64); each key-value: key (string), type (u32), value; each tensor: name
(string), dimension count (u32), dimensions innermost first (u64 each), type (u32), offset of its
data (u64) from the data section, which starts at the next multiple of ``general.alignment``
(default 32). A string is its byte length (u64) and its UTF-8 bytes.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.reader import check_types

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value type -> its struct format (8 is a string, 9 an array)."""
STRING, ARRAY = 8, 9
LONG_ARRAY = 1024
"""Arrays longer than this (a vocabulary, its merges and token types) are skipped, not read."""
_FIX = "re-download the file: it is not a complete GGUF file"


@dataclass(frozen=True)
class Unread:
    """A long array's place in :attr:`GGUFHeader.meta`: its length, not its contents."""
    length: int


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


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buf, at: int):
        self.buf, self.at = buf, at

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        raw = self.buf[self.at:self.at + n]
        if len(raw) < n:
            raise struct.error("a string runs past the end of the file")
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown value type {vtype}")
        return self.take(_SCALARS[vtype])

    def array(self):
        etype, n = self.take("<I"), self.take("<Q")
        if n > LONG_ARRAY:
            self.skip(etype, n)
            return Unread(n)
        return [self.value(etype) for _ in range(n)]

    def skip(self, etype: int, n: int) -> None:
        if etype in _SCALARS:
            self.at += struct.calcsize(_SCALARS[etype]) * n
        elif etype == STRING:
            length, buf, at = struct.Struct("<Q").unpack_from, self.buf, self.at
            for _ in range(n):  # the hot loop of a vocabulary: no method calls
                at += 8 + length(buf, at)[0]
            self.at = at
        else:
            for _ in range(n):
                self.value(etype)


def read_header(path: Path | str) -> GGUFHeader:
    """The header of the GGUF file ``path``; one :class:`UserError` per way it is unreadable
    (not GGUF, an old version, cut short: its header or its tensor data)."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except (struct.error, ValueError, OverflowError) as e:  # ValueError: an empty file too
        raise UserError(path, f"cannot be read as GGUF ({e})", _FIX) from None


def _parse(buf, path: Path) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise ValueError("it does not start with the GGUF magic")
    c = _Cursor(buf, 4)
    version = c.take("<I")
    if version not in (2, 3):
        raise ValueError(f"version {version}; versions 2 and 3 are read")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.take("<I"))
    tensors = {}
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
        tensors[name] = TensorInfo(dims, gguf.GGMLQuantizationType(c.take("<I")), c.take("<Q"))
    align = meta.get("general.alignment", 32)
    start = -(-c.at // align) * align
    end = max((start + t.offset + t.n_bytes for t in tensors.values()), default=start)
    if end > len(buf):
        raise ValueError(f"its tensors need {end:,} bytes, the file has {len(buf):,}: cut short")
    return GGUFHeader(path, meta, tensors)
