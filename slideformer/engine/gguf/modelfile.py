"""An Ollama ``Modelfile`` for an exported GGUF: template, stop tokens, parameters.

Ollama templates are Go templates, not the model's Jinja2 chat template, and Ollama guesses
only some chat templates from a GGUF's metadata. The template is therefore recognised by what
it renders: the model's own template (in the sandbox) is rendered on a sample conversation
and compared with each known style; a match gets that style's Go template, and a default
system prompt the Jinja2 template inserts becomes ``SYSTEM``. Other templates get a comment
that says the TEMPLATE must be written by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from slideformer.engine.errors import UserError
from slideformer.engine.models.tokenizer import TokenizerInfo


@dataclass(frozen=True)
class ChatStyle:
    """A chat format: how a turn is written, in Python (to compare) and as a Go template."""

    name: str
    turn: Callable[[str, str], str]
    """(role, content) -> the text of one turn."""
    prompt: str
    """What opens the assistant's turn (add_generation_prompt)."""
    stop: str
    """The token that ends a turn."""
    go_template: str


CHATML = ChatStyle(
    "ChatML", lambda r, c: f"<|im_start|>{r}\n{c}<|im_end|>\n", "<|im_start|>assistant\n",
    "<|im_end|>",
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n'
    '{{ end }}<|im_start|>assistant\n')
LLAMA3 = ChatStyle(
    "Llama 3", lambda r, c: f"<|start_header_id|>{r}<|end_header_id|>\n\n{c}<|eot_id|>",
    "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>",
    '{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n'
    '{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n')
STYLES = (CHATML, LLAMA3)
_SAMPLE = [{"role": "system", "content": "S1"}, {"role": "user", "content": "U1"},
           {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]


def detect_style(tok: TokenizerInfo) -> tuple[ChatStyle | None, str | None]:
    """(the chat style of the model's template, its default system prompt) or (None, None)."""
    if tok.chat_template is None:
        return None, None
    try:
        full = _strip_bos(tok, tok.render_chat(_SAMPLE, add_generation_prompt=True))
        bare = _strip_bos(tok, tok.render_chat(_SAMPLE[1:2], add_generation_prompt=True))
    except UserError:
        return None, None
    for style in STYLES:
        if full != "".join(style.turn(m["role"], m["content"]) for m in _SAMPLE) + style.prompt:
            continue
        user_turn = style.turn("user", "U1") + style.prompt
        if bare == user_turn:
            return style, None
        head = bare.removesuffix(user_turn)
        before, _, after = style.turn("system", "\0").partition("\0")
        if (bare.endswith(user_turn) and len(head) >= len(before) + len(after)
                and head.startswith(before) and head.endswith(after)):
            return style, head[len(before):len(head) - len(after)]
        return style, None
    return None, None


def _strip_bos(tok: TokenizerInfo, text: str) -> str:
    # llama.cpp and Ollama add BOS themselves (tokenizer.ggml.add_bos_token)
    return text.removeprefix(tok.bos_token) if tok.bos_token else text


def modelfile(gguf_name: str, tok: TokenizerInfo, context: int) -> str:
    """The text of a Modelfile that runs ``gguf_name`` (a file next to it) in Ollama."""
    style, system = detect_style(tok)
    lines = ["# Ollama: ollama create <name> -f Modelfile && ollama run <name>",
             f"FROM ./{gguf_name}", ""]
    stops = [s for s in dict.fromkeys([style.stop if style else None, tok.eos_token]) if s]
    if style is not None:
        lines += [f"# chat template: {style.name} (converted from the model's chat template)",
                  f'TEMPLATE """{style.go_template}"""']
        if system is not None:
            lines.append(f'SYSTEM """{system}"""')
    else:
        lines += ["# The model's chat template is not one of the styles this exporter converts",
                  "# (ChatML, Llama 3): Ollama will use the template it reads from the GGUF if",
                  "# it recognises it; otherwise write a TEMPLATE here by hand."]
    lines += [""] + [f'PARAMETER stop "{s}"' for s in stops]
    lines += ["PARAMETER temperature 0.7", "PARAMETER top_p 0.9",
              f"PARAMETER num_ctx {min(context, 4096)}", ""]
    return "\n".join(lines)
