"""Chat rendering and assistant spans: which characters of a rendered conversation are trained.

The model's own ``chat_template`` is used (rendered in the tokenizer module's sandbox); a built-in
ChatML template only when the model has none, and the caller is told (:attr:`ChatRenderer.
builtin`). The template is compiled once (engine.models.tokenizer caches it): compiling costs
~0.8 ms, rendering ~10 us, and the span search renders each conversation several times.

Assistant spans are found by rendering prefixes of the conversation: for assistant message i,
``render(m[:i], add_generation_prompt=True)`` ends where the reply starts and ``render(m[:i+1])``
ends after the reply and its end-of-turn marker (trailing whitespace after the marker is not
trained). Both must be prefixes of the full rendering. Templates that render history differently
from the last turn (e.g. Qwen3 drops old reasoning) fail that test; those turns are located by
wrapping the reply in private-use sentinel characters instead. The token mask is then taken
over the tokenization of the full rendering (a token is trained when it overlaps a span), so
the trained sequence is exactly what tokenizing the rendering gives.
"""
from __future__ import annotations

from engine.errors import UserError
from engine.models import tokenizer as tokmod
from engine.models.tokenizer import TokenizerInfo

CHATML = ("{{ bos_token }}{% for m in messages %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BUILTIN_WHERE = "built-in ChatML template"
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: never in real text


class ChatRenderer:
    """Renders conversations with a model's chat template (or the built-in ChatML one)."""

    def __init__(self, tok: TokenizerInfo):
        self.builtin = tok.chat_template is None
        self.source = CHATML if self.builtin else tok.chat_template
        self.where = BUILTIN_WHERE if self.builtin else str(tok.source / "tokenizer_config.json")
        self._ctx = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The rendered conversation; a template failure is a :class:`UserError`."""
        ctx = dict(self._ctx, messages=messages, add_generation_prompt=add_generation_prompt)
        return tokmod.render_template(self.source, self.where, **ctx)  # sandboxed, budgeted

    def spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of every assistant reply within ``full``."""
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            span = self._prefix_span(messages, i, full) or self._sentinel_span(messages, i, full)
            if span is None:
                raise UserError(self.where, f"cannot locate assistant message {i + 1} in the "
                                "rendered conversation (the template rewrites it)",
                                'set data.train_on = "all", or use a template that renders '
                                "each message's content verbatim")
            out.append(span)
        return out

    def _quiet(self, messages: list[dict], add_generation_prompt: bool) -> str | None:
        """Render, or None where the template rejects a partial conversation."""
        try:
            return self.render(messages, add_generation_prompt)
        except UserError:
            return None

    def _prefix_span(self, messages, i, full) -> tuple[int, int] | None:
        before = self._quiet(messages[:i], True)
        upto = self._quiet(messages[:i + 1], False)
        if before is None or upto is None:
            return None
        if not (full.startswith(upto) and upto.startswith(before)):
            return None
        return len(before), max(len(before), len(upto.rstrip()))

    def _sentinel_span(self, messages, i, full) -> tuple[int, int] | None:
        marked = list(messages)
        marked[i] = dict(messages[i], content=_OPEN + messages[i]["content"] + _CLOSE)
        text = self._quiet(marked, False)
        upto = self._quiet(marked[:i + 1], False)
        if text is None or upto is None or any(
                s.count(_OPEN) != 1 or s.count(_CLOSE) != 1 for s in (text, upto)):
            return None
        if text.replace(_OPEN, "").replace(_CLOSE, "") != full:
            return None
        start, end = text.index(_OPEN), text.index(_CLOSE) - 1
        # The end-of-turn marker is whatever the template writes after the reply when it is
        # the last message; it is trained too, so the model learns to stop.
        marker = upto[upto.index(_CLOSE) + 1:].rstrip()
        if full.startswith(marker, end):
            end += len(marker)
        return start, end


def token_ranges(enc, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For each character span, the tokens [first, end) of ``enc`` that overlap it.

    Overlap rather than containment: where the template puts a space before the reply
    ("Assistant: 8") the tokenizer merges it into the reply's first token (" 8"), and that token
    must be trained or the model never learns to start its answer. Only the span ends are
    looked up (``char_to_token``), not every token: per-token Python loops cost more than the
    tokenizer itself.
    """
    n, out = len(enc.ids), []
    for a, b in spans:
        first = _covering(enc, range(a, b))
        if first is None:
            continue
        last = _covering(enc, range(b - 1, a - 1, -1))
        # several tokens can cover the last character (a character split into byte tokens)
        while last + 1 < n and (enc.token_to_chars(last + 1) or (b, b))[0] < b:
            last += 1
        out.append((first, last + 1))
    return out


def _covering(enc, chars) -> int | None:
    """The first token covering the first covered character of ``chars``."""
    for c in chars:
        k = enc.char_to_token(c)
        if k is not None:
            return k
    return None
