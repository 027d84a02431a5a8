"""Conversations as chat templates see them: messages, tool schemas, and which replies train.

Messages are normalised to what Hugging Face chat templates expect (the shape
``apply_chat_template`` is documented to take):

- ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``;
- an assistant's tool calls as ``"tool_calls": [{"type": "function", "function": {"name": str,
  "arguments": dict}}]`` (OpenAI writes ``arguments`` as a JSON string; templates such as Qwen2.5
  and Llama 3.1 apply ``tojson`` to it, so a string would be encoded twice);
- ``tool_call_id``, ``name`` and ``reasoning_content`` kept where given;
- tool schemas as ``{"type": "function", "function": {...}}`` (a bare ``{"name", ...}`` schema,
  as LLaMA-Factory writes them, is wrapped).

Anything a template would not see correctly (an unknown key, an image part, a weight other than
0 or 1) is a :class:`UserError` naming the record and the message.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from slideformer.engine.data.records import Record
from slideformer.engine.errors import UserError

MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
"""Message keys passed to the template as given (after normalisation)."""
_MEDIA = re.compile(r"<(image|audio|video)>")
MEDIA_KEYS = ("images", "image", "videos", "video", "audios", "audio")


@dataclass(frozen=True)
class Conversation:
    """One conversation to render with a chat template."""

    messages: list
    """{"role", "content", ...} dicts, in the shape chat templates expect."""
    trained: tuple
    """Per message: True where it is an assistant reply that carries a loss."""
    tools: list | None = None
    """Tool schemas, passed to the template as ``tools`` (None: no tools)."""

    def __bool__(self) -> bool:
        return bool(self.messages)


def refuse_media(rec: Record, text: str, where: str) -> None:
    """Refuse text holding an <image>/<audio>/<video> placeholder (multimodal data)."""
    m = _MEDIA.search(text)
    if m:
        raise UserError(rec.where, f"{where} holds a {m.group(0)} placeholder: this is "
                        "multimodal data, and only text models are trained here",
                        "remove the media records (or the placeholders) from the file")


def media_error(rec: Record, key: str) -> UserError:
    return UserError(rec.where, f"the record has a '{key}' field: this is multimodal data, and "
                     "only text models are trained here", "remove the media records from the file")


def content(rec: Record, value, where: str, key: str, allow_none: bool) -> str:
    """A message's text: a string, a list of text parts (joined), or None where allowed."""
    if value is None and allow_none:
        return ""
    if isinstance(value, list):  # OpenAI content parts
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                if kind in ("image_url", "image", "input_audio", "audio", "video"):
                    raise UserError(rec.where, f"{where} has a '{kind}' content part: this is "
                                    "multimodal data, and only text models are trained here",
                                    "remove the media records from the file")
                raise UserError(rec.where, f"{where} has a content part that is not "
                                '{"type": "text", "text": ...}', "write the content as text")
            texts.append(part["text"])
        value = "".join(texts)
    if not isinstance(value, str):
        raise UserError(rec.where, f"{where} has a {type_name(value)} '{key}', expected a string",
                        f"make '{key}' a string")
    refuse_media(rec, value, where)
    return value


def tool_calls(rec: Record, value, where: str) -> list:
    """Normalised tool calls; arguments given as JSON text are parsed."""
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise UserError(rec.where, f"{where} has a tool call that is a {type_name(call)}",
                            'write each call as {"type": "function", "function": {"name": ..., '
                            '"arguments": {...}}}')
        fn = call.get("function", call)
        name, args = (fn.get("name"), fn.get("arguments", {})) if isinstance(fn, dict) else (
            None, None)
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise UserError(rec.where, f"{where}: the arguments of tool call {name!r} are "
                                f"not valid JSON ({e.msg})", "write the arguments as a JSON "
                                "object") from None
        if not isinstance(name, str) or not isinstance(args, dict):
            raise UserError(rec.where, f"{where} has a tool call without a string 'name' and "
                            "an object of 'arguments'", 'write each call as {"type": "function",'
                            ' "function": {"name": ..., "arguments": {...}}}')
        norm = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call.get("id"), str):
            norm["id"] = call["id"]
        out.append(norm)
    return out


def tools(rec: Record, value, key: str) -> list | None:
    """Tool schemas of a record (a list, or a JSON text of one, as LLaMA-Factory stores it)."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(rec.where, f"'{key}' is text that is not valid JSON ({e.msg})",
                            f"write '{key}' as a list of tool schemas") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise UserError(rec.where, f"'{key}' is not a list of tool schemas",
                        f'write \'{key}\' as [{{"type": "function", "function": {{"name": ...}}}}]')
    return [t if "type" in t else {"type": "function", "function": t} for t in value]


def weight(rec: Record, value, where: str) -> bool:
    """OpenAI's per-message weight: 0 (not trained) or 1."""
    if value is None:
        return True
    if isinstance(value, bool) or value not in (0, 1):
        raise UserError(rec.where, f"{where} has weight {value!r}",
                        "use weight 0 (not trained) or 1 (trained)")
    return value == 1


def type_name(value) -> str:
    return "missing value" if value is None else type(value).__name__
