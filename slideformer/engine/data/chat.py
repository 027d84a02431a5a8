"""Chat rendering and assistant spans: which characters of a rendered conversation are trained.

The model's own ``chat_template`` is used (rendered in the tokenizer module's sandbox, under its
render budget), unless ``data.chat_template`` names another ("chatml" or a .jinja file); a
built-in ChatML template only when the model has none, and the caller is told
(:attr:`ChatRenderer.builtin`). The template sees what ``transformers.apply_chat_template`` gives
it: ``messages``, ``tools``, ``add_generation_prompt``, the special tokens and
``enable_thinking``. It is compiled once (slideformer.engine.models.tokenizer caches it): compiling costs
~0.8 ms, rendering ~10 us, and the span search renders each conversation several times.

Assistant spans, in order of preference:

1. ``{% generation %}`` blocks (transformers' assistant-mask convention): the k-th block is the
   k-th assistant message.
2. Prefix renderings: for assistant message i, ``render(m[:i], add_generation_prompt=True)``
   ends where the reply starts and ``render(m[:i+1])`` ends after the reply and its end-of-turn
   marker (trailing whitespace after the marker is not trained). Both must be prefixes of the
   full rendering.
3. Sentinels, where the template renders history differently from the last turn (Qwen3 drops
   old reasoning, Mistral moves the system prompt, Phi-3.5 ends a conversation with EOS): the
   reply's text is wrapped in private-use characters. The span then reaches back over the
   spaces the template put before the reply (Mistral's " " + reply: the space merges into the
   reply's first token), and forward over what the template writes after the reply when it is
   the last message (its tool calls and end-of-turn marker), as far as the full rendering has
   the same tokens there (Phi-3.5: "<|end|>" but not the final "<|endoftext|>").

The token mask is then taken over the tokenization of the full rendering (a token is trained
when it overlaps a span), so the trained sequence is exactly what tokenizing the rendering gives.
"""
from __future__ import annotations

from pathlib import Path

from jinja2 import nodes
from jinja2.ext import Extension

from slideformer.engine.data.conversation import Conversation
from slideformer.engine.errors import UserError
from slideformer.engine.models import tokenizer as tokmod
from slideformer.engine.models.tokenizer import TokenizerInfo

CHATML = ("{{ bos_token }}"
          "{% if tools %}<|im_start|>system\n"
          "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
          "You can call these tools; write each call as <tool_call>{\"name\": ..., "
          "\"arguments\": {...}}</tool_call>:\n"
          "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
          "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "{% for c in m['tool_calls'] or [] %}<tool_call>"
          "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
          "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML; with tools, their schemas go into the system turn and calls are written as
``<tool_call>{json}</tool_call>`` after the reply's text (the Hermes / Qwen convention)."""
BUILTIN_WHERE = "built-in ChatML template"
TEMPLATES = {"chatml": CHATML}
"""Templates ``data.chat_template`` can name."""
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: never in real text
_GEN_OPEN, _GEN_CLOSE = "\ue002", "\ue003"


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: marks the text of an assistant reply."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        return _GEN_OPEN + caller() + _GEN_CLOSE


_ENV = tokmod._ENV.overlay(extensions=[_Generation])


def template_source(tok: TokenizerInfo, choice: str) -> tuple[str, str, bool]:
    """(template, where it comes from, built-in fallback?) for ``data.chat_template``."""
    if choice in TEMPLATES:
        return TEMPLATES[choice], f"data.chat_template = {choice!r}", False
    if choice:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise UserError("data.chat_template", f"is {choice!r}, neither a file nor a "
                            "template name", f"give a .jinja file or one of: "
                            f"{', '.join(TEMPLATES)} (empty: the model's own)")
        try:
            return path.read_text(encoding="utf-8"), str(path), False
        except UnicodeDecodeError as e:
            raise UserError(path, f"is not valid UTF-8 ({e.reason} at byte {e.start})",
                            "save the template as UTF-8 text") from None
    if tok.chat_template is None:
        return CHATML, BUILTIN_WHERE, True
    return tok.chat_template, str(tok.template_where), False


class ChatRenderer:
    """Renders conversations with a chat template and locates their trained replies."""

    def __init__(self, tok: TokenizerInfo, template: str = "", enable_thinking: bool = True):
        self.source, self.where, self.builtin = template_source(tok, template)
        self.tok = tok
        self._ctx = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or "",
                     "enable_thinking": enable_thinking}
        self.generation_tags = "generation" in self.source and "endgeneration" in self.source
        self._replies: bool | None = None
        """Whether the template renders replies at all (None: not asked yet)."""

    def render(self, conv: Conversation, add_generation_prompt: bool = False,
               messages: list | None = None) -> str:
        """The rendered conversation (``messages`` replaces its messages when given)."""
        return _strip_gen(self._raw(conv, add_generation_prompt, messages))

    def _raw(self, conv, add_generation_prompt, messages=None) -> str:
        ctx = dict(self._ctx, messages=conv.messages if messages is None else messages,
                   tools=conv.tools, add_generation_prompt=add_generation_prompt)
        # sandboxed and budgeted, with the generation tag
        return tokmod.render_template(self.source, self.where, env=_ENV, **ctx)

    def check(self, conv: Conversation, where: str) -> None:
        """Refuse what the template would silently leave out (tools, tool calls, reasoning)."""
        needs = [("tools", conv.tools is not None, "tool schemas")]
        for m in conv.messages:
            needs.append(("tool_calls", "tool_calls" in m, "tool calls"))
            needs.append(("reasoning_content", "reasoning_content" in m, "reasoning_content"))
        for name, used, what in needs:
            if used and name not in self.source:
                raise UserError(where, f"the record has {what}, but the chat template "
                                f"({self.where}) does not render them",
                                "use a model whose chat template supports them, or set "
                                "data.chat_template to a template file that does")

    def drops_system(self, conv: Conversation) -> bool:
        """True when the system prompt of ``conv`` is not in its rendering (Mistral v0.3)."""
        if not conv.messages or conv.messages[0]["role"] != "system":
            return False
        return self.render(conv) == self.render(conv, messages=conv.messages[1:])

    def spans(self, conv: Conversation, full: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of the trained replies within ``full``."""
        if self.generation_tags:
            return self._generation_spans(conv)
        out = []
        for i, m in enumerate(conv.messages):
            if not conv.trained[i]:
                continue
            low = out[-1][1] if out else 0
            span = (self._prefix_span(conv, i, full)
                    or self._sentinel_span(conv, i, full, low))
            if span is None:
                raise UserError(self.where, f"cannot locate assistant message {i + 1} in the "
                                "rendered conversation (the template rewrites it)",
                                'set data.train_on = "all", or use a template that renders '
                                "each message's content verbatim")
            if span[0] == span[1] and m.get("content") and not self._renders_replies(conv):
                raise UserError(self.where, "chat_template does not render the assistant's "
                                "messages (a reply is missing from its output)",
                                "use the model's original chat template, or set "
                                "data.chat_template to one that renders every message")
            out.append(span)
        return out

    def _renders_replies(self, conv: Conversation) -> bool:
        """Whether a reply shows in the template's output at all (asked once, when a reply
        renders as nothing: every record would be dropped as having nothing to train)."""
        if self._replies is None:
            probe = [{"role": "user", "content": "Hello."},
                     {"role": "assistant", "content": _OPEN + "reply" + _CLOSE}]
            text = self._quiet(conv, probe, False)
            self._replies = text is None or _OPEN + "reply" + _CLOSE in text
        return self._replies

    def _generation_spans(self, conv: Conversation) -> list[tuple[int, int]]:
        raw, out, removed, pos = self._raw(conv, False), [], 0, 0
        while (a := raw.find(_GEN_OPEN, pos)) >= 0:  # positions in the text without markers
            b = raw.find(_GEN_CLOSE, a)
            out.append((a - removed, b - removed - 1))
            removed, pos = removed + 2, b + 1
        replies = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        if len(out) != len(replies):
            if all(conv.trained[i] for i in replies):
                return [s for s in out if s[1] > s[0]]
            raise UserError(self.where, f"the template's {{% generation %}} blocks "
                            f"({len(out)}) do not match the {len(replies)} assistant messages",
                            "train every reply (no weight 0, data.mask_history off) with this "
                            "template")
        return [s for i, s in zip(replies, out) if conv.trained[i] and s[1] > s[0]]

    def _quiet(self, conv: Conversation, messages: list, add_generation_prompt: bool):
        """Render, or None where the template rejects a partial conversation."""
        try:
            return self.render(conv, add_generation_prompt, messages)
        except UserError:
            return None

    def _prefix_span(self, conv, i, full) -> tuple[int, int] | None:
        before = self._quiet(conv, conv.messages[:i], True)
        upto = self._quiet(conv, conv.messages[:i + 1], False)
        if before is None or upto is None:
            return None
        if not (full.startswith(upto) and upto.startswith(before)):
            return None
        return len(before), max(len(before), len(upto.rstrip()))

    def _sentinel_span(self, conv, i, full, low: int) -> tuple[int, int] | None:
        marked = list(conv.messages)
        marked[i], head = _marked(conv.messages[i])
        text = self._quiet(conv, marked, False)
        upto = self._quiet(conv, marked[:i + 1], False)
        if text is None or upto is None or any(
                s.count(_OPEN) != 1 or s.count(_CLOSE) != 1 for s in (text, upto)):
            return None
        if text.replace(_OPEN, "").replace(_CLOSE, "") != full:
            return None
        start, end = text.index(_OPEN), text.index(_CLOSE) - 1
        if not conv.messages[i]["content"]:
            # Only tool calls, marked at their names: the reply starts where the template's
            # generation prompt ends (the text before the first name is the call's own).
            start = self._reply_start(conv, i, full, low, start)
            if start is None:
                return None
        while start > low and full[start - 1] in " \t":
            start -= 1
        if head:  # rendered reasoning (Qwen3 keeps it after the last user turn) is trained too
            k = full.rfind("<think>", low, start)
            if k >= 0 and head.split("<think>")[-1].strip("\n") in full[k:start]:
                start = k
        tail = upto[upto.index(_CLOSE) + 1:]
        return start, end + len(self._common_tokens(tail, full[end:end + len(tail)]).rstrip())

    def _reply_start(self, conv, i, full, low: int, mark: int) -> int | None:
        prompt = self._quiet(conv, conv.messages[:i], True)
        plain = self._quiet(conv, conv.messages[:i], False)
        if prompt is None or plain is None or not prompt.startswith(plain):
            return None
        gen = prompt[len(plain):]
        k = full.rfind(gen, low, mark) if gen else -1
        return None if k < 0 else k + len(gen)

    def _common_tokens(self, tail: str, there: str) -> str:
        """The longest run of whole tokens of ``tail`` that ``there`` starts with."""
        enc = self.tok.tok.encode(tail, add_special_tokens=False)
        best = 0
        for _, stop in enc.offsets:
            if tail[:stop] != there[:stop]:
                break
            best = stop
        return tail[:best]


def _marked(m: dict) -> tuple[dict, str]:
    """(the message with sentinels around its reply, its reasoning head).

    The sentinels go around the answer of a reasoning reply (templates that drop old reasoning,
    such as Qwen3, keep only the answer of history turns), or, for a reply that is only tool
    calls, from the first call's name to the last one's (empty content must stay empty: a
    template may test it).
    """
    content = m["content"]
    if not content and m.get("tool_calls"):
        calls = [dict(c, function=dict(c["function"])) for c in m["tool_calls"]]
        calls[0]["function"]["name"] = _OPEN + calls[0]["function"]["name"]
        calls[-1]["function"]["name"] += _CLOSE
        return dict(m, tool_calls=calls), ""
    k = content.find("</think>")
    if k < 0:
        return dict(m, content=_OPEN + content + _CLOSE), ""
    k += len("</think>")
    while k < len(content) and content[k] == "\n":
        k += 1
    return dict(m, content=content[:k] + _OPEN + content[k:] + _CLOSE), content[:k]


def _strip_gen(text: str) -> str:
    return text.replace(_GEN_OPEN, "").replace(_GEN_CLOSE, "") if _GEN_OPEN in text else text


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
