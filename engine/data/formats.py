"""Record formats: detection, validation and conversion to one of two document kinds.

Every record becomes either plain text (``str``) or a conversation (a list of
``{"role", "content"}`` messages, roles system / user / assistant):

=========  ==========================================  =====================================
format     record                                      document
=========  ==========================================  =====================================
text       ``{"text": str}`` or a .txt paragraph        the text
alpaca     ``{"instruction", "output", "input"?,        [system?], user: instruction + input,
           "system"?}``                                 assistant: output
messages   ``{"messages": [{"role", "content"}]}``      the messages
sharegpt   ``{"conversations": [{"from", "value"}]}``   from human/gpt/system mapped to
                                                        user/assistant/system
=========  ==========================================  =====================================

``auto`` detects the format from the first record of each file and then requires every record
of that file to fit it, so a stray record is reported at its own line rather than silently read
some other way.
"""
from __future__ import annotations

from typing import Union

from engine.data.records import Record
from engine.errors import UserError

FORMATS = ("auto", "text", "alpaca", "messages", "sharegpt")
CHAT_FORMATS = ("alpaca", "messages", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "function_response": "tool", "observation": "tool"}

Document = Union[str, list]
"""Plain text, or a list of {"role", "content"} messages."""

# The key that identifies each format, in detection order (most specific first).
_SIGNATURES = (("messages", "messages"), ("sharegpt", "conversations"),
               ("alpaca", "instruction"), ("text", "text"))


def detect(rec: Record) -> str:
    """The format of one record; a record that fits none is a :class:`UserError`."""
    if isinstance(rec.value, str):
        return "text"
    for fmt, key in _SIGNATURES:
        if key in rec.value:
            return fmt
    keys = ", ".join(sorted(rec.value)) or "none"
    raise UserError(rec.where, f"the record fits no known format (its keys: {keys})",
                    'give each record "text", "instruction"+"output", "messages" or '
                    '"conversations", or set data.format')


def to_document(rec: Record, fmt: str, origin: str) -> Document:
    """Validate ``rec`` against ``fmt`` and convert it.

    Args:
        rec: the raw record.
        fmt: text, alpaca, messages or sharegpt.
        origin: why this format applies, for the error text ("detected from line 1").
    """
    if isinstance(rec.value, str):
        if fmt != "text":
            raise UserError(rec.file, f"is a .txt file but the format is {fmt} ({origin})",
                            "set data.format to auto or text for .txt files")
        return rec.value
    return _CONVERTERS[fmt](rec, f"format {fmt}, {origin}")


def _field(rec: Record, key: str, why: str, kind=str, required: bool = True):
    value = rec.value.get(key)
    if value is None:
        if required:
            raise UserError(rec.where, f"the record has no '{key}' field ({why})",
                            f"add '{key}' to the record, or set data.format to its real format")
        return None
    if not isinstance(value, kind):
        raise UserError(rec.where, f"'{key}' is a {_type(value)}, expected a {kind.__name__} "
                        f"({why})", f"make '{key}' a {kind.__name__}")
    return value


def _text(rec: Record, why: str) -> Document:
    return _field(rec, "text", why)


def _alpaca(rec: Record, why: str) -> Document:
    instruction = _field(rec, "instruction", why)
    output = _field(rec, "output", why)
    extra = _field(rec, "input", why, required=False)
    system = _field(rec, "system", why, required=False)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user},
                       {"role": "assistant", "content": output}]


def _messages(rec: Record, why: str) -> Document:
    turns = _field(rec, "messages", why, kind=list)
    return [_turn(rec, i, t, "role", "content", {r: r for r in ROLES}) for i, t in enumerate(turns)]


def _sharegpt(rec: Record, why: str) -> Document:
    turns = _field(rec, "conversations", why, kind=list)
    return [_turn(rec, i, t, "from", "value", SHAREGPT_ROLES) for i, t in enumerate(turns)]


def _turn(rec: Record, i: int, turn, role_key: str, text_key: str, roles: dict) -> dict:
    """One message of a conversation, with its role mapped to system/user/assistant/tool."""
    where = f"message {i + 1}"
    if not isinstance(turn, dict):
        raise UserError(rec.where, f"{where} is a {_type(turn)}, expected an object",
                        f'write each message as {{"{role_key}": ..., "{text_key}": ...}}')
    role, text = turn.get(role_key), turn.get(text_key)
    if role not in roles:
        raise UserError(rec.where, f"{where} has {role_key}={role!r}",
                        f"use one of: {', '.join(roles)}")
    if not isinstance(text, str):
        raise UserError(rec.where, f"{where} has a {_type(text)} '{text_key}', expected a string",
                        f"make '{text_key}' a string")
    return {"role": roles[role], "content": text}


def _type(value) -> str:
    return "missing value" if value is None else type(value).__name__


_CONVERTERS = {"text": _text, "alpaca": _alpaca, "messages": _messages, "sharegpt": _sharegpt}


def is_empty(doc: Document) -> bool:
    """True for a document with nothing to learn from (blank text, no messages)."""
    if isinstance(doc, str):
        return not doc.strip()
    return not doc
