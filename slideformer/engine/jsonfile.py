"""Reading JSON that comes from the user's files, with one :class:`UserError` for every way it
can be broken.

``json.loads`` raises more than ``JSONDecodeError`` on hostile input: ``RecursionError`` for
arrays nested thousands deep, ``ValueError`` for integers past Python's 4300-digit conversion
limit; and it accepts lone surrogates (``"\\ud800"``), which later fail wherever the text is
encoded. These helpers turn each into a message naming the file (and line, where given).
"""
from __future__ import annotations

import json
from pathlib import Path

from slideformer.engine.errors import UserError


def parse_json(text: str | bytes, where: str | Path, fix: str):
    """The value of a JSON text; ``where`` names it in the error (a file, or ``file:line``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(where, f"is not valid JSON ({e.msg} at line {e.lineno} column "
                        f"{e.colno})", fix) from None
    except UnicodeDecodeError as e:
        raise UserError(where, f"is not valid UTF-8 ({e.reason})", fix) from None
    except RecursionError:
        raise UserError(where, "is JSON nested too deeply to read", fix) from None
    except ValueError as e:  # an integer of thousands of digits
        raise UserError(where, f"holds a number too large to read ({e})", fix) from None


def read_json(path: Path | str, fix: str):
    """The value of a JSON file (:func:`parse_json` of its bytes)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(path, f"cannot be read ({e.strerror})", fix) from None
    return parse_json(raw, path, fix)


def lone_surrogate(value) -> str | None:
    """The first string of a JSON value (keys too) that is not encodable text, else None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def surrogate_key(obj: dict) -> str | None:
    """The first top-level key of a JSON object whose entry (key or value) holds a lone
    surrogate (see :func:`lone_surrogate`), else None: what a message names."""
    return next((k for k, v in obj.items() if lone_surrogate([k, v]) is not None), None)
