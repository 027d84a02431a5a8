"""Open a GGUF file (``gguf.GGUFReader``, memory-mapped) with one clear error per way it fails.

:class:`GGUFFile` holds the metadata as plain Python values and the tensor table by name;
:meth:`GGUFFile.tensor` dequantises one tensor (``gguf.quants.dequantize``), so reading a
model costs one tensor of memory at a time on top of the mapping.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from slideformer.engine.errors import UserError


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


class GGUFFile:
    """A GGUF file's metadata (``meta``: key -> value) and tensors (``tensors``: name -> info)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(self.path, "is not a file", "pass the path of a .gguf file")
        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, IndexError, OSError, KeyError) as e:
            raise UserError(self.path, f"cannot be read as GGUF ({e})",
                            "pass a complete .gguf file (re-download it if it was cut short)") from None
        self.meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
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
