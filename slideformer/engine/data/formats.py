"""Record formats: detection, validation and conversion to one of two document kinds.

Every record becomes either plain text (``str``) or a :class:`Conversation`:

=========  ===============================================  =================================
format     record                                           document
=========  ===============================================  =================================
text       ``{"text"}`` or a .txt paragraph                  the text
alpaca     ``{"instruction", "output", "input"?,             [system], history pairs, user:
           "system"?, "history"?: [[user, reply], ...]}``   instruction + input, assistant
messages   ``{"messages": [{"role", "content", ...}],        the messages; ``weight: 0``
           "system"?, "tools"?}``                           replies are not trained
sharegpt   ``{"conversations": [{"from", "value"}],          human/gpt/system/function_call/
           "system"?, "tools"?}``                           observation mapped to roles
=========  ===============================================  =================================

Field and role names can be remapped (``[data.columns]``). Every field of a record is used or the
record is refused: preference data (``chosen``/``rejected``, KTO ``label``) and multimodal data
(``images``, ``<image>`` placeholders in conversations; plain text may hold such tags) get
their own message, any other unknown field names
itself. Fields that only describe a record (``id``, ``source``, ... :data:`META_KEYS`, and
``data.ignore_fields``) are ignored. A field whose value is null counts as absent (a Parquet
row has every column of its file).

``auto`` detects the format from the first record of each file and then requires every record
of that file to fit it, so a stray record is reported at its own line rather than silently read
some other way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Union

from slideformer.engine.config import ColumnMap, DataConfig
from slideformer.engine.data import conversation as conv
from slideformer.engine.data.conversation import Conversation
from slideformer.engine.data.records import Record
from slideformer.engine.errors import UserError

FORMATS = ("auto", "text", "alpaca", "messages", "sharegpt")
CHAT_FORMATS = ("alpaca", "messages", "sharegpt")
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "model": "assistant", "function": "tool", "function_response": "tool",
         "observation": "tool", "ipython": "tool"}
CALL_ROLES = ("function_call",)
"""ShareGPT roles whose value is an assistant's tool call (JSON), not text."""
META_KEYS = frozenset({"id", "idx", "uuid", "source", "dataset", "category", "task", "lang",
                       "language", "url", "license", "meta", "metadata", "model", "timestamp"})
"""Fields that describe a record and hold nothing to train on."""
PREFERENCE_KEYS = ("chosen", "rejected")

Document = Union[str, Conversation]
"""Plain text, or a conversation."""


@dataclass(frozen=True)
class Schema:
    """Field and role names of the records, from ``data.columns`` and the formats' defaults."""

    columns: ColumnMap
    ignore: frozenset
    mask_history: bool

    @classmethod
    def of(cls, cfg: DataConfig) -> "Schema":
        return cls(cfg.columns, META_KEYS | frozenset(cfg.ignore_fields), cfg.mask_history)

    def key(self, name: str, default: str) -> str:
        return getattr(self.columns, name) or default

    def chat_key(self, fmt: str) -> str:
        return self.key("messages", "conversations" if fmt == "sharegpt" else "messages")

    def roles(self) -> dict:
        c, out = self.columns, dict(ROLES)
        for tag, role in ((c.user_tag, "user"), (c.assistant_tag, "assistant"),
                          (c.system_tag, "system"), (c.observation_tag, "tool")):
            if tag:
                out[tag] = role
        return out

    def call_roles(self) -> tuple:
        return CALL_ROLES + ((self.columns.function_tag,) if self.columns.function_tag else ())


def detect(rec: Record, schema: Schema) -> str:
    """The format of one record; a record that fits none is a :class:`UserError`."""
    if isinstance(rec.value, str):
        return "text"
    _refuse_kind(rec)
    for fmt, key in (("messages", schema.chat_key("messages")),
                     ("sharegpt", schema.chat_key("sharegpt")),
                     ("alpaca", schema.key("prompt", "instruction")),
                     ("text", schema.key("text", "text"))):
        if _present(rec, key):
            return fmt
    keys = ", ".join(sorted(rec.value)) or "none"
    raise UserError(rec.where, f"the record fits no known format (its keys: {keys})",
                    'give each record "text", "instruction"+"output", "messages" or '
                    '"conversations", map your field names in [data.columns], or set data.format')


def to_document(rec: Record, fmt: str, origin: str, schema: Schema) -> Document:
    """Validate ``rec`` against ``fmt`` and convert it.

    Args:
        rec: the raw record.
        fmt: text, alpaca, messages or sharegpt.
        origin: why this format applies, for the error text ("detected from line 1").
        schema: field and role names.
    """
    if isinstance(rec.value, str):
        if fmt != "text":
            raise UserError(rec.file, f"is a .txt file but the format is {fmt} ({origin})",
                            "set data.format to auto or text for .txt files")
        return rec.value
    _refuse_kind(rec)
    why = f"format {fmt}, {origin}"
    if fmt == "text":
        key = schema.key("text", "text")
        _only(rec, schema, (key,), why)
        return _field(rec, key, why, media=False)  # "<video>" in web text is just text
    if fmt == "alpaca":
        return _alpaca(rec, why, schema)
    return _chat(rec, fmt, why, schema)


def _present(rec: Record, key: str) -> bool:
    return rec.value.get(key) is not None


def _refuse_kind(rec: Record) -> None:
    """Preference and multimodal records: refused with their own message."""
    v = rec.value
    if any(_present(rec, k) for k in PREFERENCE_KEYS):
        raise UserError(rec.where, "the record holds preference data ('chosen'/'rejected', as "
                        "for DPO or ORPO), which supervised fine-tuning does not read",
                        "train on pairs with train.objective = \"dpo\" (or orpo, simpo; CLI "
                        "--objective dpo; `slideformer data inspect FILE --pairs` shows them), "
                        "or train on the 'chosen' replies as a messages or Alpaca file")
    if _present(rec, "prompt") and _present(rec, "answer") and not any(
            k in v for k in ("completion", "response", "output", "text", "messages")):
        raise UserError(rec.where, "the record holds a prompt and its answer (GRPO's prompts: "
                        "the model writes the replies), which supervised fine-tuning does not "
                        "read", "train with train.objective = \"grpo\" (CLI --objective grpo; "
                        "`slideformer data inspect FILE --prompts` shows them), or write the "
                        "answer as the reply of an Alpaca record (prompt -> instruction, answer "
                        "-> output)")
    if _present(rec, "kto_tag") or (_present(rec, "label") and ("completion" in v
                                                                  or "prompt" in v)):
        raise UserError(rec.where, "the record holds KTO preference data (a 'label' marking "
                        "the completion good or bad), which supervised fine-tuning does not read",
                        "train with train.objective = \"kto\" (CLI --objective kto; `slideformer "
                        "data inspect FILE --kto` shows them) on records "
                        "{\"prompt\", \"completion\", \"label\"} as TRL writes them, or keep "
                        "the records labelled true as an Alpaca file (prompt -> instruction, "
                        "completion -> output)")
    for key in conv.MEDIA_KEYS:
        if _present(rec, key):
            raise conv.media_error(rec, key)


def _only(rec: Record, schema: Schema, used: tuple, why: str) -> None:
    """Refuse a field the format does not use (unless it is metadata or ignored)."""
    for key, value in rec.value.items():
        if value is None or key in used or key in schema.ignore:
            continue
        raise UserError(rec.where, f"the record has a field '{key}' that is not used ({why}, "
                        f"which uses {', '.join(used)})",
                        f"remove '{key}', map it in [data.columns], or list it in "
                        "data.ignore_fields if it holds nothing to train on")


def _field(rec: Record, key: str, why: str, kind=str, required: bool = True,
           media: bool = True):
    value = rec.value.get(key)
    if value is None:
        if required:
            raise UserError(rec.where, f"the record has no '{key}' field ({why})",
                            f"add '{key}' to the record, or set data.format to its real format")
        return None
    if not isinstance(value, kind):
        raise UserError(rec.where, f"'{key}' is a {conv.type_name(value)}, expected a "
                        f"{kind.__name__} ({why})", f"make '{key}' a {kind.__name__}")
    if isinstance(value, str) and media:
        conv.refuse_media(rec, value, f"'{key}'")
    return value


def _alpaca(rec: Record, why: str, schema: Schema) -> Document:
    names = {n: schema.key(n, d) for n, d in (("prompt", "instruction"), ("query", "input"),
                                              ("response", "output"), ("system", "system"),
                                              ("history", "history"))}
    _only(rec, schema, tuple(names.values()), why)
    instruction = _field(rec, names["prompt"], why)
    output = _field(rec, names["response"], why)
    extra = _field(rec, names["query"], why, required=False)
    system = _field(rec, names["system"], why, required=False)
    history = _field(rec, names["history"], why, kind=list, required=False) or []
    messages = [{"role": "system", "content": system}] if system else []
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str)
                                                                   for t in pair)):
            raise UserError(rec.where, f"'{names['history']}' item {i + 1} is not a pair of "
                            "strings", f"write '{names['history']}' as [[instruction, reply], "
                            "...]")
        for role, text in zip(("user", "assistant"), pair):
            conv.refuse_media(rec, text, f"'{names['history']}' item {i + 1}")
            messages.append({"role": role, "content": text})
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    trained = [m["role"] == "assistant" for m in messages]
    return Conversation(messages, _history_mask(trained, schema))


def _chat(rec: Record, fmt: str, why: str, schema: Schema) -> Document:
    key, sys_key, tools_key = (schema.chat_key(fmt), schema.key("system", "system"),
                               schema.key("tools", "tools"))
    _only(rec, schema, (key, sys_key, tools_key), why)
    turns = _field(rec, key, why, kind=list)
    system = _field(rec, sys_key, why, required=False)
    role_key = schema.key("role_tag", "from" if fmt == "sharegpt" else "role")
    text_key = schema.key("content_tag", "value" if fmt == "sharegpt" else "content")
    messages, trained = [], []
    for i, t in enumerate(turns):
        m, train = _turn(rec, i, t, role_key, text_key, schema)
        messages.append(m)
        trained.append(train)
    if system:
        if messages and messages[0]["role"] == "system":
            raise UserError(rec.where, f"the record has both a '{sys_key}' field and a system "
                            "message", "keep one of the two system prompts")
        messages.insert(0, {"role": "system", "content": system})
        trained.insert(0, False)
    tools = conv.tools(rec, rec.value.get(tools_key), tools_key)
    return Conversation(messages, _history_mask(trained, schema), tools)


def _turn(rec: Record, i: int, turn, role_key: str, text_key: str,
          schema: Schema) -> tuple[dict, bool]:
    """One message with its role mapped, and whether it is trained."""
    where = f"message {i + 1}"
    if not isinstance(turn, dict):
        raise UserError(rec.where, f"{where} is a {conv.type_name(turn)}, expected an object",
                        f'write each message as {{"{role_key}": ..., "{text_key}": ...}}')
    roles, calls = schema.roles(), schema.call_roles()
    role = turn.get(role_key)
    if role not in roles and role not in calls:
        raise UserError(rec.where, f"{where} has {role_key}={role!r}",
                        f"use one of: {', '.join(list(roles) + list(calls))}, or map the role "
                        "name in [data.columns]")
    for k, value in turn.items():
        if value is not None and k not in (role_key, text_key, "weight", *conv.MESSAGE_KEYS):
            raise UserError(rec.where, f"{where} has a field '{k}' that is not used",
                            f"remove '{k}' from the messages (used: {role_key}, {text_key}, "
                            f"weight, {', '.join(conv.MESSAGE_KEYS)})")
    train = conv.weight(rec, turn.get("weight"), where)
    if role in calls:  # ShareGPT function_call: the value is the call itself, as JSON
        return {"role": "assistant", "content": "",
                "tool_calls": conv.tool_calls(rec, _json_value(rec, turn.get(text_key), where),
                                              where)}, train
    m = {"role": roles[role]}
    m["content"] = conv.content(rec, turn.get(text_key), where, text_key,
                                allow_none=turn.get("tool_calls") is not None)
    for k in conv.MESSAGE_KEYS:
        if turn.get(k) is not None:
            m[k] = conv.tool_calls(rec, turn[k], where) if k == "tool_calls" else turn[k]
    return m, train and m["role"] == "assistant"


def _json_value(rec: Record, value, where: str):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(rec.where, f"{where} is a function call that is not valid JSON "
                        f"({e.msg})", 'write it as {"name": ..., "arguments": {...}}') from None


def _history_mask(trained: list, schema: Schema) -> tuple:
    """With data.mask_history only the last trained reply keeps its loss."""
    if schema.mask_history and any(trained):
        last = max(i for i, t in enumerate(trained) if t)
        trained = [i == last for i in range(len(trained))]
    return tuple(trained)


def is_empty(doc: Document) -> bool:
    """True for a document with nothing to learn from (blank text, no messages)."""
    if isinstance(doc, str):
        return not doc.strip()
    return not doc.messages
