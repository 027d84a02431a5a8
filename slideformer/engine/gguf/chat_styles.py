"""Chat formats the GGUF export hands to Ollama: recognised by rendering, written as Go templates.

A model's chat template is Jinja2; an Ollama ``TEMPLATE`` is a Go ``text/template`` that sees
``.Messages`` (each ``.Role``, ``.Content``, ``.Thinking``), ``.System`` (the system messages,
joined by a blank line) and ``.Think`` / ``.IsThinkSet`` (the request's ``think`` option). When a
request has no system message and the Modelfile has ``SYSTEM``, Ollama puts one with it first in
``.Messages``; Ollama and llama.cpp add the BOS token themselves.

A :class:`ChatStyle` is one format written as the text around each turn. Both renderings come
from it: :func:`render` in Python and :func:`go_template` for Ollama, one the mirror of the other.
A model's template is recognised (:func:`detect_style`) when it renders a set of probe
conversations exactly as a style does; the probes also find what a template writes by itself
(:class:`ChatFormat`): a default system prompt (SmolLM2, Qwen2.5), which becomes the Modelfile's
``SYSTEM``, or a preamble the system turn always starts with (Llama 3.1 and 3.2's knowledge and
date lines), which makes the Go template write that turn always.

Qwen3 (ChatML with thinking) as Ollama runs it:

- the reply's opening is ``<|im_start|>assistant\\n``, followed by the empty think block
  ``<think>\\n\\n</think>\\n\\n`` only when the request sets ``think`` to false: Qwen3's
  ``enable_thinking=False``. Unset or true, the model opens its own ``<think>``, as with
  Qwen3's default;
- an assistant turn is written without its reasoning, as Qwen3's template writes every turn
  before the last user message; only a turn after the last user message (a reply being
  continued) gets ``<think>\\n{.Thinking}\\n</think>\\n\\n`` before its content. That block is also
  how Ollama infers the model's thinking tags, so it parses ``<think>...</think>`` out of replies
  into ``thinking`` and accepts the ``think`` option.

What the Go templates leave out, since Go's text/template has no string functions (Ollama adds
only ``json``): trimming message content (Llama 3, Gemma and Mistral's templates strip the
whitespace around each message), reasoning written inside ``content`` (Qwen3's template cuts it
out; Ollama passes it in ``thinking``), tool schemas and calls.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from slideformer.engine.errors import UserError
from slideformer.engine.models.tokenizer import TokenizerInfo

EMPTY_THINK = "<think>\n\n</think>\n\n"
"""What Qwen3's template appends to the reply's opening for ``enable_thinking=False``."""


@dataclass(frozen=True)
class ChatStyle:
    """A chat format, as the text around each turn's content."""

    name: str
    user: tuple[str, str]
    """Text before and after a user message's content."""
    assistant: tuple[str, str]
    """Text before and after an assistant message's content."""
    prompt: str
    """What opens the reply (``add_generation_prompt``)."""
    stops: tuple[str, ...]
    """Stop strings: the token that ends a turn, then the one that starts a turn (a reply that
    forgets to end stops before it writes the user's next turn)."""
    system: tuple[str, str] | None = None
    """Text before and after a system prompt in a turn of its own; None: no such turn, the
    prompt joins a user turn (:attr:`fold`)."""
    fold: str = ""
    """``first`` or ``last``: the user turn a system prompt joins, as ``{system}\\n\\n{content}``
    (Gemma: the first; Mistral: the last, if the conversation ends with it)."""
    thinking: bool = False
    """Qwen3's reasoning (see the module's docstring)."""


def _header(role: str) -> tuple[str, str]:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"


CHATML = ChatStyle("ChatML", user=("<|im_start|>user\n", "<|im_end|>\n"),
                   assistant=("<|im_start|>assistant\n", "<|im_end|>\n"),
                   prompt="<|im_start|>assistant\n", stops=("<|im_end|>", "<|im_start|>"),
                   system=("<|im_start|>system\n", "<|im_end|>\n"))
QWEN3 = replace(CHATML, name="Qwen3 (ChatML with thinking)", thinking=True)
LLAMA3 = ChatStyle("Llama 3", user=_header("user"), assistant=_header("assistant"),
                   prompt=_header("assistant")[0], stops=("<|eot_id|>", "<|start_header_id|>"),
                   system=_header("system"))
MISTRAL = ChatStyle("Mistral", user=("[INST] ", "[/INST]"), assistant=(" ", "</s>"), prompt="",
                    stops=("</s>", "[INST]"), fold="last")
GEMMA = ChatStyle("Gemma", user=("<start_of_turn>user\n", "<end_of_turn>\n"),
                  assistant=("<start_of_turn>model\n", "<end_of_turn>\n"),
                  prompt="<start_of_turn>model\n", stops=("<end_of_turn>", "<start_of_turn>"),
                  fold="first")
STYLES = (QWEN3, CHATML, LLAMA3, MISTRAL, GEMMA)


@dataclass(frozen=True)
class ChatFormat:
    """A recognised chat template: its style, and what the template writes by itself."""

    style: ChatStyle
    system: str | None = None
    """The system prompt the template writes when a conversation has none (the Modelfile's
    ``SYSTEM``); None: it writes none."""
    preamble: str | None = None
    """Text the system turn starts with, that turn then written even without a system prompt
    (Llama 3.1: the knowledge and date lines); None: the turn is written only for a prompt."""


def render(fmt: ChatFormat, messages: list[dict], think: bool | None = None) -> str:
    """What :func:`go_template` of ``fmt`` writes in Ollama for ``messages``, the reply's
    opening included.

    Args:
        messages: as a chat template takes them; an assistant's ``reasoning_content`` is what
            Ollama calls ``thinking``. The Modelfile's ``SYSTEM`` (``fmt.system``) goes first
            when they do not start with a system message, as Ollama does.
        think: the request's ``think`` option; None: not set.
    """
    st = fmt.style
    if fmt.system is not None and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": fmt.system}, *messages]
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    out = []
    if st.system is not None and fmt.preamble is not None:
        out.append(st.system[0] + fmt.preamble + system + st.system[1])
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    first = True
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "system":
            if st.system is not None and fmt.preamble is None:
                out.append(st.system[0] + content + st.system[1])
            continue
        if role == "user":
            folds = first if st.fold == "first" else st.fold == "last" and i == len(messages) - 1
            out.append(st.user[0] + (system + "\n\n" if folds and system else "") + content
                       + st.user[1])
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or ""
            head = (f"<think>\n{reasoning}\n</think>\n\n"
                    if st.thinking and reasoning and i > last_user else "")
            out.append(st.assistant[0] + head + content + st.assistant[1])
        first = False
    out.append(st.prompt + (EMPTY_THINK if st.thinking and think is False else ""))
    return "".join(out)


def go_template(fmt: ChatFormat) -> str:
    """The Ollama ``TEMPLATE`` of ``fmt`` (Go text/template; see :func:`render`).

    No ``{{-`` or ``-}}``: they would also trim the newlines that end the turns' own text.
    """
    st = fmt.style
    t = []
    if st.system is not None and fmt.preamble is not None:
        t.append(_text(st.system[0] + fmt.preamble) + "{{ .System }}" + _text(st.system[1]))
    if st.thinking:
        t.append('{{ $lastUser := -1 }}{{ range $i, $m := .Messages }}'
                 '{{ if eq $m.Role "user" }}{{ $lastUser = $i }}{{ end }}{{ end }}')
    if st.fold == "first":
        t.append("{{ $first := true }}")
    t.append("{{ range $i, $m := .Messages }}")
    if st.fold == "last":
        t.append("{{ $last := eq (len (slice $.Messages $i)) 1 }}")
    t.append('{{ if eq .Role "system" }}')
    if st.system is not None and fmt.preamble is None:
        t.append(_text(st.system[0]) + "{{ .Content }}" + _text(st.system[1]))
    t.append('{{ else if eq .Role "user" }}' + _text(st.user[0]))
    if st.fold:
        t.append(f"{{{{ if and ${st.fold} $.System }}}}{{{{ $.System }}}}\n\n{{{{ end }}}}")
    t.append("{{ .Content }}" + _text(st.user[1]))
    t.append('{{ else if eq .Role "assistant" }}' + _text(st.assistant[0]))
    if st.thinking:  # Ollama takes its thinking tags from the text around a .Thinking field in
        # the range over .Messages: the condition reads $m.Thinking, so only this block's counts
        t.append("{{ if and $m.Thinking (gt $i $lastUser) }}<think>\n{{ .Thinking }}\n"
                 "</think>\n\n{{ end }}")
    t.append("{{ .Content }}" + _text(st.assistant[1]) + "{{ end }}")
    if st.fold == "first":
        t.append('{{ if ne .Role "system" }}{{ $first = false }}{{ end }}')
    t.append("{{ end }}" + _text(st.prompt))
    if st.thinking:
        t.append("{{ if and $.IsThinkSet (not $.Think) }}" + EMPTY_THINK + "{{ end }}")
    return "".join(t)


def _text(s: str) -> str:
    """``s`` as literal text of a Go template (``{{`` would open an action)."""
    return s.replace("{{", '{{ "{{" }}')


# Probe conversations: each turn distinct, so a template that moves, drops or repeats one shows.
_S = {"role": "system", "content": "S1"}
_U1, _U2 = {"role": "user", "content": "U1"}, {"role": "user", "content": "U2"}
_A1 = {"role": "assistant", "content": "A1"}
_PROBES: tuple[tuple[list[dict], bool | None], ...] = (
    ([_U1], None), ([_S, _U1], None), ([_U1, _A1, _U2], None), ([_S, _U1, _A1, _U2], None),
    ([_U1, dict(_A1, reasoning_content="R1"), _U2], None), ([_S, _U1, _A1, _U2], False))
"""(messages, enable_thinking; None: not passed), each rendered with the reply's opening."""


def detect_style(tok: TokenizerInfo) -> ChatFormat | None:
    """The chat format of the model's template, or None when it is none of :data:`STYLES`
    (or there is no template, or it fails on a probe)."""
    if tok.chat_template is None:
        return None
    # without the BOS token: llama.cpp and Ollama add it themselves (tokenizer.ggml.add_bos_token)
    try:
        seen = [tok.render_chat(messages, True, bos_token="",
                                **({} if think is None else {"enable_thinking": think}))
                for messages, think in _PROBES]
    except UserError:
        return None
    for style in STYLES:
        for fmt in _candidates(style, seen[0]):
            if all(render(fmt, messages, think) == text
                   for (messages, think), text in zip(_PROBES, seen)):
                return fmt
    return None


def _candidates(style: ChatStyle, bare: str):
    """The formats of ``style`` that may explain ``bare`` (the first probe as rendered): none
    of its own text, or a system turn it writes unasked (a default prompt, or a preamble)."""
    yield ChatFormat(style)
    if style.system is None:
        return
    tail = render(ChatFormat(style), _PROBES[0][0])
    head = bare[:len(bare) - len(tail)] if bare.endswith(tail) else ""
    before, after = style.system
    if len(head) >= len(before) + len(after) and head.startswith(before) and head.endswith(after):
        text = head[len(before):len(head) - len(after)]
        if text:  # an empty SYSTEM is no system prompt to Ollama
            yield ChatFormat(style, system=text)
        yield ChatFormat(style, preamble=text)

