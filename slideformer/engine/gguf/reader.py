"""Open a GGUF file (``gguf.GGUFReader``, memory-mapped) with one clear error per way it fails.

:class:`GGUFFile` holds the metadata as plain Python values and the tensor table by name;
:meth:`GGUFFile.tensor` dequantises one tensor (``gguf.quants.dequantize``), so reading a
model costs one tensor of memory at a time on top of the mapping. The file's structure is
checked first (:func:`~slideformer.engine.gguf.header.read_header`): ``gguf.GGUFReader``
trusts the lengths and offsets it reads. The metadata is the header's, so that import and the
discovery scan see the same values; only the long arrays it skips (a vocabulary, its merges)
come from ``gguf.GGUFReader``, which flattens arrays of arrays (``[[]]`` reads as ``[]``): such
an array stays unread, and a typed read refuses it.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.header import ARRAY, Unread, check_types, read_header


class GGUFFile:
    """A GGUF file's metadata (``meta``: key -> value) and tensors (``tensors``: name -> info)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(self.path, "is not a file", "pass the path of a .gguf file")
        header = read_header(self.path)  # every structural check, before GGUFReader's walk
        try:
            reader = gguf.GGUFReader(self.path)
            self.meta = {k: reader.fields[k].contents() if _flat_long(v) else v
                         for k, v in header.meta.items()}
        except (ValueError, IndexError, OSError, KeyError) as e:  # ValueError: not UTF-8 too
            raise UserError(self.path, f"cannot be read as GGUF ({e})",
                            "pass a complete .gguf file (re-download it if it was cut short)") from None
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    def check_types(self) -> None:
        check_types(self.path, (t.tensor_type for t in self.tensors.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def tensor(self, name: str) -> np.ndarray:
        """One tensor, dequantised to float32, in PyTorch order."""
        t = self.tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))


def _flat_long(value) -> bool:
    """A long array of scalars or strings: what ``gguf.GGUFReader`` reads as it is."""
    return isinstance(value, Unread) and value.etype != ARRAY
