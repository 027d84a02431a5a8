"""An Ollama ``Modelfile`` for an exported GGUF: template, system prompt, stop strings, parameters.

Ollama templates are Go templates, not the model's Jinja2 chat template, and Ollama guesses only
some chat templates from a GGUF's metadata. The model's template is therefore recognised by what
it renders (:func:`slideformer.engine.gguf.chat_styles.detect_style`) and written as that style's
Go template; a default system prompt it inserts becomes ``SYSTEM``. Other templates get a comment
that says the TEMPLATE must be written by hand.
"""
from __future__ import annotations

from slideformer.engine.gguf.chat_styles import STYLES, ChatFormat, detect_style, go_template
from slideformer.engine.models.tokenizer import TokenizerInfo


def modelfile(gguf_name: str, tok: TokenizerInfo, context: int) -> str:
    """The text of a Modelfile that runs ``gguf_name`` (a file next to it) in Ollama."""
    fmt = detect_style(tok)
    lines = ["# Ollama: ollama create <name> -f <this file> && ollama run <name>",
             f"FROM ./{gguf_name}", ""]
    lines += _chat_lines(fmt) if fmt is not None else _unknown_lines(tok)
    stops = dict.fromkeys([*(fmt.style.stops if fmt else ()), tok.eos_token])
    lines += [""] + [f'PARAMETER stop "{s}"' for s in stops if s]
    lines += ["PARAMETER temperature 0.7", "PARAMETER top_p 0.9",
              f"PARAMETER num_ctx {min(context, 4096)}", ""]
    return "\n".join(lines)


def _chat_lines(fmt: ChatFormat) -> list[str]:
    lines = [f"# chat template: {fmt.style.name} (converted from the model's chat template)"]
    if fmt.preamble:
        lines.append("# Every prompt starts with the system turn's fixed text, as the model's "
                     "template wrote it on export.")
    if fmt.style.thinking:
        lines += ["# Thinking: on unless a request sets think to false (ollama run <name> "
                  "--think=false), which writes",
                  "# the empty think block of enable_thinking=False; earlier turns' reasoning "
                  "is left out, as the model's template does."]
    template = go_template(fmt)
    if '"""' in template:  # only from a preamble: the styles' own text has none
        return lines + ['# The template holds """, which a Modelfile cannot quote: write a '
                        "TEMPLATE here by hand."]
    lines.append(f'TEMPLATE """{template}"""')
    if fmt.system is not None:
        lines.append(f'SYSTEM """{fmt.system}"""' if '"""' not in fmt.system else
                     '# The default system prompt holds """, which a Modelfile cannot quote.')
    return lines


def _unknown_lines(tok: TokenizerInfo) -> list[str]:
    if tok.chat_template is None:
        return ["# The model has no chat template: Ollama will use the template it reads from "
                "the GGUF, if any;", "# otherwise write a TEMPLATE here by hand."]
    return ["# The model's chat template is not one of the styles this exporter converts",
            f"# ({', '.join(s.name for s in STYLES)}): Ollama will use the template it reads "
            "from the GGUF if", "# it recognises it; otherwise write a TEMPLATE here by hand."]
