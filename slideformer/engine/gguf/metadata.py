"""Typed reads of a GGUF file's metadata: a value of the wrong type is one message naming the key.

GGUF values carry their own types, and a hand-edited or hostile file can put a string where a
count belongs, a float where a token id does, an integer where a flag does (``bool(2)`` is
True, ``int("12")`` 12): read unchecked, these raised TypeError and ValueError from deep in
import, or were taken. Each read here names the type it needs; integers of any width pass as
integers (llama.cpp writes u32 and i32), never a bool; a float may be given as an integer and
must be finite. Works on :class:`~slideformer.engine.gguf.reader.GGUFFile` (values as Python
lists) and on :class:`~slideformer.engine.gguf.header.GGUFHeader` (long arrays
:class:`~slideformer.engine.gguf.header.Unread`, with their element type).
"""
from __future__ import annotations

import math

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.header import Unread

_WORDS = {int: "an integer", float: "a finite number", str: "a string", bool: "a boolean"}
_ETYPES = {int: (0, 1, 2, 3, 4, 5, 10, 11), float: (0, 1, 2, 3, 4, 5, 6, 10, 11, 12),
           str: (8,), bool: (7,)}
"""Python type -> the GGUF element types an array of it may have (an :class:`Unread` one)."""
_FIX = "use the GGUF file as llama.cpp's converter wrote it (this value was changed or is corrupt)"


def _is(value, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    return isinstance(value, kind)


def _shown(value) -> str:
    if isinstance(value, Unread):
        return f"an array of {value.length:,}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def value(g, key: str, kind: type, default=None):
    """Metadata ``key`` of ``g`` as ``kind`` (int, float, str, bool), ``default`` when absent."""
    v = g.get(key)
    if v is None:
        return default
    if not _is(v, kind):
        raise UserError(g.path, f"has '{key}' = {_shown(v)}, which is not {_WORDS[kind]}", _FIX)
    return float(v) if kind is float else v


def array(g, key: str, kind: type, default=None):
    """Metadata ``key`` as an array whose items are ``kind``: a list, or an :class:`Unread`
    (checked by its element type), ``default`` when absent."""
    v = g.get(key)
    if v is None:
        return default
    if isinstance(v, Unread):
        ok = v.etype in _ETYPES[kind]
    else:
        ok = isinstance(v, list) and all(_is(x, kind) for x in v)
    if not ok:
        raise UserError(g.path, f"has '{key}' = {_shown(v)}, which is not an array of "
                        f"{_WORDS[kind].split(' ', 1)[1]}s", _FIX)
    return v


def length(v) -> int:
    """The length of an array read by :func:`array`."""
    return v.length if isinstance(v, Unread) else len(v)
