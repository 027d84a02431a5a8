"""Ollama Modelfiles: each chat style's TEMPLATE, run by Go's own text/template, writes exactly
what the model's Jinja2 chat template writes.

The reference is the real chat template of each model (tests/fixtures/chat_templates) rendered
with ``add_generation_prompt=True``, less the BOS token where the GGUF adds one. The Go side is
``py-go-template`` (Go's text/template through cgo; its wheels are manylinux x86_64 only): without
it those tests skip. It ends the whole process on a template error, so it renders in a child
process. Its values are what Ollama passes a template: ``.Messages`` with the Modelfile's SYSTEM
first when a conversation has no system message, ``.System``, ``.Think``, ``.IsThinkSet``. The
conversations alternate roles, so Ollama's merging of consecutive same-role messages changes
nothing.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from slideformer.engine.gguf.chat_styles import (CHATML, GEMMA, LLAMA3, MISTRAL, QWEN3, ChatFormat,
                                                 detect_style)
from slideformer.engine.gguf.modelfile import modelfile
from slideformer.engine.models.families.gemma3 import CHAT_TEMPLATE as GEMMA3_FALLBACK
from slideformer.engine.models.tiny import CHAT_TEMPLATE as TINY_CHATML
from slideformer.engine.models.tokenizer import TokenizerInfo, render_template

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
LLAMA = ("<|begin_of_text|>", "<|eot_id|>", True)
MODELS = {
    # name: (template, bos, eos, whether the GGUF adds BOS, style, stop strings)
    "smollm2": ("smollm2.jinja", "<|im_start|>", "<|im_end|>", False, CHATML,
                ["<|im_end|>", "<|im_start|>"]),
    "qwen2.5": ("qwen2.5.jinja", None, "<|im_end|>", False, CHATML, ["<|im_end|>", "<|im_start|>"]),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>", False, QWEN3, ["<|im_end|>", "<|im_start|>"]),
    "tiny-llama": (TINY_CHATML, *LLAMA, CHATML, ["<|im_end|>", "<|im_start|>", "<|eot_id|>"]),
    "llama-3": ("llama-3.jinja", *LLAMA, LLAMA3, ["<|eot_id|>", "<|start_header_id|>"]),
    "llama-3.1": ("llama-3.1.jinja", *LLAMA, LLAMA3, ["<|eot_id|>", "<|start_header_id|>"]),
    "llama-3.2": ("llama-3.2.jinja", *LLAMA, LLAMA3, ["<|eot_id|>", "<|start_header_id|>"]),
    "mistral-v0.3": ("mistral-v0.3.jinja", "<s>", "</s>", True, MISTRAL, ["</s>", "[INST]"]),
    "gemma-3": ("gemma-3.jinja", "<bos>", "<eos>", True, GEMMA,
                ["<end_of_turn>", "<start_of_turn>", "<eos>"]),
    "gemma3-fallback": (GEMMA3_FALLBACK, "<bos>", "<end_of_turn>", True, GEMMA,
                        ["<end_of_turn>", "<start_of_turn>"]),
}
GO_BUILTINS = {"if", "else", "end", "range", "and", "or", "not", "eq", "ne", "gt", "lt", "len",
               "slice", "index", "true", "false"}
"""Keywords and functions of Go's text/template the templates may use."""
SYSTEM = {"role": "system", "content": "You are terse.\nAnswer in one line."}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 7 + 5?"}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."},
     {"role": "user", "content": "And an even one?"}],
    [{"role": "user", "content": "Übersetze: cat"}, {"role": "assistant", "content": "Katze 🐈"},
     {"role": "user", "content": "Plural?"}, {"role": "assistant", "content": "Katzen\n\nok"},
     {"role": "user", "content": 'Literal {{ .System }}, """ and <b>&amp;</b>?'}],
]


def tokenizer(name: str) -> TokenizerInfo:
    template, bos, eos = MODELS[name][:3]
    text = template if "{" in template else (TEMPLATES / template).read_text(encoding="utf-8")
    return TokenizerInfo(Tokenizer(models.BPE()), bos, eos, None, text, Path(name))


def hf_render(name: str, messages: list[dict], **variables) -> str:
    """The model's own template, less the BOS token that llama.cpp and Ollama add."""
    tok, (_, bos, _, adds_bos) = tokenizer(name), MODELS[name][:4]
    text = render_template(tok.chat_template, name, messages=messages, add_generation_prompt=True,
                           bos_token=bos or "", eos_token=tok.eos_token, **variables)
    if adds_bos:
        assert text.startswith(bos)
        return text.removeprefix(bos)
    return text


def parse_modelfile(text: str) -> dict:
    """TEMPLATE, SYSTEM (verbatim between triple quotes, as Ollama's parser reads them) and the
    stop strings of a Modelfile."""
    quoted = dict(re.findall(r'^(TEMPLATE|SYSTEM) """(.*?)"""$', text, re.MULTILINE | re.DOTALL))
    return {"template": quoted.get("TEMPLATE"), "system": quoted.get("SYSTEM"),
            "stops": re.findall(r'^PARAMETER stop "(.*)"$', text, re.MULTILINE)}


def ollama_values(messages: list[dict], system: str | None, think: bool | None) -> dict:
    """The values Ollama's chat handler gives a template for ``messages``."""
    if system is not None and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": system}, *messages]
    return {"Messages": [{"Role": m["role"], "Content": m["content"],
                          "Thinking": m.get("reasoning_content", "")} for m in messages],
            "System": "\n\n".join(m["content"] for m in messages if m["role"] == "system"),
            "Tools": None, "Response": "", "Think": bool(think), "IsThinkSet": think is not None}


_CHILD = """
import json, sys
from pathlib import Path
import go_template
jobs = Path(sys.argv[1])
out = [go_template.render(jobs / f"{i}.tmpl", values).decode("utf-8")
       for i, values in enumerate(json.loads((jobs / "values.json").read_text()))]
(jobs / "out.json").write_text(json.dumps(out))
"""


def go_render(template: str, values: list[dict], tmp_path: Path) -> list[str]:
    """``template`` rendered by Go's text/template with each of ``values``."""
    pytest.importorskip("go_template")
    for i in range(len(values)):
        (tmp_path / f"{i}.tmpl").write_text(template, encoding="utf-8")
    (tmp_path / "values.json").write_text(json.dumps(values))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"Go refused the template: {done.stdout}{done.stderr}")
    return json.loads((tmp_path / "out.json").read_text())


def conversations() -> list[list[dict]]:
    """Each conversation without and with a system message."""
    return [c for conv in CONVERSATIONS for c in (conv, [SYSTEM, *conv])]


@pytest.mark.parametrize("name", MODELS)
def test_go_template_writes_what_the_chat_template_writes(name, tmp_path):
    tok = tokenizer(name)
    fmt = detect_style(tok)
    assert fmt is not None and fmt.style == MODELS[name][4]
    mf = parse_modelfile(modelfile("m.gguf", tok, 8192))
    assert mf["template"] is not None
    # only Go's own functions, which Ollama has too (py-go-template adds sprig's, Ollama does not)
    actions = " ".join(re.findall(r"{{(.*?)}}", mf["template"]))
    words = set(re.findall(r"(?<![.$\w])[a-z]\w*", re.sub(r'"[^"]*"', "", actions)))
    assert words <= GO_BUILTINS, words - GO_BUILTINS
    convs = conversations()
    got = go_render(mf["template"], [ollama_values(c, mf["system"], None) for c in convs], tmp_path)
    for conv, text in zip(convs, got):
        assert text == hf_render(name, conv), conv


def test_qwen3_thinking(tmp_path):
    """think=false writes Qwen3's empty think block; true and unset leave the thinking to the
    model; reasoning is left out of turns before the last user message and kept after it."""
    mf = parse_modelfile(modelfile("m.gguf", tokenizer("qwen3"), 8192))
    reasoned = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                {"role": "user", "content": "3+3?"}]
    continued = [*reasoned, {"role": "assistant", "content": "6", "reasoning_content": "Again."}]
    cases = [(conv, think) for conv in (*conversations(), reasoned, continued)
             for think in (None, True, False)]
    got = go_render(mf["template"], [ollama_values(c, None, t) for c, t in cases], tmp_path)
    for (conv, think), text in zip(cases, got):
        variables = {} if think is None else {"enable_thinking": think}
        assert text == hf_render("qwen3", conv, **variables), (conv, think)
    assert got[-1].count("<think>\nAgain.\n</think>\n\n6") == 1 and "Add them." not in got[-1]
    # Ollama takes the thinking tags from the text around {{ .Thinking }} (its only use)
    assert mf["template"].count(".Thinking }}") == 1
    assert "<think>\n{{ .Thinking }}\n</think>\n\n{{ end }}" in mf["template"]


def test_default_system_prompt_becomes_system(tmp_path):
    mf = parse_modelfile(modelfile("m.gguf", tokenizer("smollm2"), 8192))
    assert mf["system"] == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert parse_modelfile(modelfile("m.gguf", tokenizer("qwen3"), 8192))["system"] is None


def test_llama3_system_turn_is_always_written():
    fmt = detect_style(tokenizer("llama-3.1"))
    assert fmt == ChatFormat(LLAMA3, preamble="Cutting Knowledge Date: December 2023\n"
                                               "Today Date: 26 Jul 2024\n\n")
    assert detect_style(tokenizer("llama-3")) == ChatFormat(LLAMA3)
    text = modelfile("m.gguf", tokenizer("llama-3.1"), 8192)
    assert "the system turn's fixed text" in text


@pytest.mark.parametrize("name", MODELS)
def test_stop_parameters_per_style(name):
    assert parse_modelfile(modelfile("m.gguf", tokenizer(name), 8192))["stops"] == MODELS[name][5]


def test_unknown_template_gets_the_explanatory_comment():
    phi = (TEMPLATES / "phi3.5.jinja").read_text(encoding="utf-8")
    tok = TokenizerInfo(Tokenizer(models.BPE()), "<s>", "<|endoftext|>", None, phi, Path("phi"))
    assert detect_style(tok) is None
    text = modelfile("m.gguf", tok, 131072)
    assert "is not one of the styles this exporter converts" in text
    assert "write a TEMPLATE here by hand" in text and "TEMPLATE \"\"\"" not in text
    mf = parse_modelfile(text)
    assert mf["template"] is None and mf["stops"] == ["<|endoftext|>"]
    assert "PARAMETER num_ctx 4096" in text and "FROM ./m.gguf" in text
    bare = TokenizerInfo(Tokenizer(models.BPE()), None, "</s>", None, None, Path("b"))
    assert "The model has no chat template" in modelfile("m.gguf", bare, 2048)


def _tok_with(template: str, bos="<|begin_of_text|>") -> TokenizerInfo:
    return TokenizerInfo(Tokenizer(models.BPE()), bos, "<|eot_id|>", None, template, Path("t"))


def test_detection_by_rendering():
    llama3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
              "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    assert detect_style(_tok_with(llama3)) == ChatFormat(LLAMA3)
    default_system = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
                      "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                      "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert detect_style(_tok_with(default_system)) == ChatFormat(CHATML, system="Be brief.")
    # a template that keeps only some turns, one that fails, one that drops the system prompt
    assert detect_style(_tok_with("[INST] {{ messages[0]['content'] }} [/INST]")) is None
    assert detect_style(_tok_with("{{ raise_exception('no') }}")) is None
    gemma_no_system = GEMMA3_FALLBACK.replace("{{ system }}\n\n", "")
    assert detect_style(_tok_with(gemma_no_system, "<bos>")) is None
    # Qwen3's template renders like plain ChatML until asked not to think
    assert detect_style(tokenizer("qwen3")).style is QWEN3
    assert detect_style(tokenizer("qwen2.5")).style is CHATML
