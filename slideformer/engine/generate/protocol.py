"""``slideformer chat --json``: requests as JSON lines on stdin, events as JSON lines on stdout.

The desktop app runs generation in this child process (as it runs training), so the app never
computes in its own process. The child holds no conversation: each request carries the whole
conversation, and the reply streams back as it is generated.

Requests (one JSON object a line)::

    {"op": "generate", "id": 7, "messages": [{"role": "user", "content": "Hi"}],
     "settings": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 256, "seed": 0}}
    {"op": "stop", "id": 7}       # end reply 7 now (one not started ends before its first token)
    {"op": "quit"}                # also: end of stdin

Events::

    {"event": "ready", "model": ..., "mode": "resident" | "streamed", "device": ..., ...}
    {"event": "token", "id": 7, "text": "Hel"}
    {"event": "done", "id": 7, "reason": "eos" | "length" | "stopped", "prompt_tokens": 31,
     "new_tokens": 12, "prefill_s": 0.2, "decode_s": 0.9, "tokens_per_s": 12.2}
    {"event": "error", "id": 7, "message": "..."}     # this request failed; the child goes on
    {"event": "error", "fatal": true, "message": "..."}   # the model cannot be loaded; exit 2
"""
from __future__ import annotations

import json
import queue
import sys
import threading
from dataclasses import fields

from slideformer.engine.errors import UserError
from slideformer.engine.generate.decoder import Finished
from slideformer.engine.generate.sampling import SamplingConfig

_SETTINGS = {f.name for f in fields(SamplingConfig)}


def emit(out, **event) -> None:
    """One event, one line, flushed (the reader sees each token as it comes)."""
    out.write(json.dumps(event, ensure_ascii=False) + "\n")
    out.flush()


def sampling_from(request: dict) -> SamplingConfig:
    """The request's settings (unknown keys are an error, so a typo does not pass unseen)."""
    settings = request.get("settings") or {}
    unknown = set(settings) - _SETTINGS
    if unknown:
        raise UserError("settings", f"has unknown keys {sorted(unknown)}",
                        f"use {sorted(_SETTINGS)}")
    try:
        return SamplingConfig(**settings)
    except TypeError as e:
        raise UserError("settings", str(e), "pass numbers") from None


class Inbox:
    """Requests read from stdin on a thread; stop requests take effect at once."""

    def __init__(self, stream):
        self.queue: queue.Queue[dict | None] = queue.Queue()
        self.stopped: set = set()
        threading.Thread(target=self._read, args=(stream,), name="chat-stdin", daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError:
                request = {"op": "invalid", "line": line.strip()[:200]}
            if isinstance(request, dict) and request.get("op") == "stop":
                self.stopped.add(request.get("id"))
            else:
                self.queue.put(request if isinstance(request, dict) else {"op": "invalid"})
        self.queue.put(None)  # end of input


def serve(model, stdin=sys.stdin, stdout=sys.stdout) -> int:
    """Answer requests until ``quit`` or the end of stdin."""
    emit(stdout, event="ready", **model.describe())
    inbox = Inbox(stdin)
    while True:
        request = inbox.queue.get()
        if request is None or request.get("op") == "quit":
            return 0
        rid = request.get("id")
        if request.get("op") != "generate":
            emit(stdout, event="error", id=rid, message=f"unknown request {request}")
            continue
        try:
            _answer(model, request, rid, inbox, stdout)
        except UserError as e:
            emit(stdout, event="error", id=rid, message=str(e))


def _answer(model, request: dict, rid, inbox: Inbox, stdout) -> None:
    cfg = sampling_from(request)
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError("messages", "is missing or empty", "send the conversation so far")
    for out in model.reply(messages, cfg, should_stop=lambda: rid in inbox.stopped):
        if isinstance(out, Finished):
            emit(stdout, event="done", id=rid, reason=out.reason, prompt_tokens=out.prompt_tokens,
                 new_tokens=out.new_tokens, prefill_s=out.prefill_s, decode_s=out.decode_s,
                 tokens_per_s=out.tokens_per_s)
        else:
            emit(stdout, event="token", id=rid, text=out.text)
    inbox.stopped.discard(rid)
