"""Chat templates and loss masks, checked token by token; hostile templates refused."""
from __future__ import annotations

import pytest

from slideformer.engine.config import DataConfig
from slideformer.engine.data import IGNORE, preview
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.events import Log
from test_data_helpers import jsonl, prep, tiny_dir, tok, tokenizer_with, user_error  # noqa: F401

CONV = [{"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3 + 5, naïvely? 😀"},
        {"role": "assistant", "content": "8, the sum."}]
NO_SYSTEM = CONV[1:]

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
LLAMA3_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
           "[INST] {{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %}"
           " {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
# Like Qwen3: the last reply gets an (empty) reasoning block that history turns do not, so the
# prefix renderings are not prefixes of the full one and the sentinel path must take over.
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
            "{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# No end-of-turn marker at all: EOS must be appended (and trained).
BARE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")


def rows(tok, tmp_path, messages, **kw):
    """(input ids, labels) of the one row holding ``messages`` (unpacked)."""
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    prepared = prep(tok, tmp_path / "cache", path, max_seq_len=256, packing=False, **kw)
    mb = prepared.train.batch([0])
    assert mb.doc_ids is None
    return mb.input_ids[0].tolist(), mb.labels[0].tolist()


def check_mask(tok, tmp_path, messages, replies: list[str], eos_appended: bool = False):
    """Labels are -100 exactly on the tokens outside ``replies`` (located by string search)."""
    ids, labels = rows(tok, tmp_path, messages)
    rendered = tok.render_chat(messages)  # the reference (uncached, unmodified) path
    enc = tok.tok.encode(rendered, add_special_tokens=False)
    ref = enc.ids + ([tok.eos_id] if eos_appended else [])
    n = len(ref)
    assert ids[:n] == ref, "the row must be exactly the tokenized rendering"
    assert set(ids[n:]) <= {tok.pad_id} and set(labels[n - 1:]) == {IGNORE}
    for t in range(n - 1):  # shifted: the label at t is the next token or -100
        assert labels[t] in (IGNORE, ids[t + 1])
    spans, cursor = [], 0
    for reply in replies:
        at = rendered.index(reply, cursor)
        spans.append((at, at + len(reply)))
        cursor = at + len(reply)
    # expected: tokens overlapping a reply (a token may carry a space before it, " 8")
    expect = [any(s < b and e > a for a, b in spans) for s, e in enc.offsets]
    if eos_appended:  # the template's tail between the last reply and the EOS is trained too
        expect = [x or e > spans[-1][0] for x, (_, e) in zip(expect, enc.offsets)] + [True]
    got = [False] + [labels[t] != IGNORE for t in range(n - 1)]
    for i, (g, e) in enumerate(zip(got, expect)):
        assert g == e, f"token {i} {tok.tok.id_to_token(ref[i])!r}: trained={g}, expected {e}"
    runs, run = [], []
    for i, g in enumerate(got + [False]):
        if g:
            run.append(ref[i])
        elif run:
            runs.append(tok.decode(run))
            run = []
    assert len(runs) == len(replies)
    for got_text, reply in zip(runs, replies):
        assert got_text.removesuffix(tok.eos_token * eos_appended).strip() == reply.strip()


def test_chatml_mask_token_by_token(tok, tmp_path):
    check_mask(tok, tmp_path, CONV, ["It is 4.<|im_end|>", "8, the sum.<|im_end|>"])


def test_llama3_style_mask_token_by_token(tiny_dir, tmp_path):
    t = tokenizer_with(tiny_dir, tmp_path / "tok", LLAMA3, LLAMA3_SPECIALS, eos="<|eot_id|>")
    check_mask(t, tmp_path, CONV, ["It is 4.<|eot_id|>", "8, the sum.<|eot_id|>"])


def test_mistral_style_mask_token_by_token(tiny_dir, tmp_path):
    t = tokenizer_with(tiny_dir, tmp_path / "tok", MISTRAL, ("<s>", "</s>"), eos="</s>",
                       bos="<s>")
    check_mask(t, tmp_path, NO_SYSTEM, [" It is 4.</s>", " 8, the sum.</s>"])


def test_history_rewriting_template_uses_sentinels(tiny_dir, tmp_path, monkeypatch):
    calls = []
    original = ChatRenderer._sentinel_span
    monkeypatch.setattr(ChatRenderer, "_sentinel_span",
                        lambda self, *a: calls.append(a[1]) or original(self, *a))
    t = tokenizer_with(tiny_dir, tmp_path / "tok", THINKING)
    check_mask(t, tmp_path, CONV, ["It is 4.<|im_end|>",
                                   "<think>\n\n</think>\n\n8, the sum.<|im_end|>"])
    assert calls == [2]  # only the history reply needed the fallback


def test_eos_appended_where_template_lacks_it(tiny_dir, tmp_path):
    t = tokenizer_with(tiny_dir, tmp_path / "tok", BARE)
    check_mask(t, tmp_path, CONV, ["It is 4.", "8, the sum."], eos_appended=True)


def test_train_on_all(tok, tmp_path):
    ids, labels = rows(tok, tmp_path, CONV, train_on="all")
    n = len(tok.tok.encode(tok.render_chat(CONV), add_special_tokens=False).ids)
    assert labels[:n - 1] == ids[1:n] and set(labels[n - 1:]) == {IGNORE}


def test_builtin_chatml_when_model_has_none(tiny_dir, tmp_path):
    t = tokenizer_with(tiny_dir, tmp_path / "tok", None)
    events = []
    path = jsonl(tmp_path / "a.jsonl", [{"instruction": "Hi", "output": "Hello"}])
    p = prep(t, tmp_path / "cache", path, events, max_seq_len=64)
    assert p.stats.template == "built-in ChatML"
    warnings = [e.message for e in events if isinstance(e, Log) and e.level == "warning"]
    assert len(warnings) == 1 and "no chat_template" in warnings[0]
    sample = preview(DataConfig(train=str(path)), t, 1).samples[0].pieces
    assert sample == [("<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                       False), ("Hello<|im_end|>", True), ("\n", False)]
    # the user is told again when the tokens come from the cache
    events.clear()
    prep(t, tmp_path / "cache", path, events, max_seq_len=64)
    assert any(isinstance(e, Log) and e.level == "warning" for e in events)


HOSTILE = {
    "class": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ cycler.__init__.__globals__.os.system('true') }}",
    "range": "{% for i in range(10**9) %}x{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_refused(tiny_dir, tmp_path, name):
    t = tokenizer_with(tiny_dir, tmp_path / "tok", HOSTILE[name])
    path = jsonl(tmp_path / "a.jsonl", [{"messages": CONV}])
    for run in (lambda: prep(t, tmp_path / "cache", path),
                lambda: preview(DataConfig(train=str(path)), t)):
        err = user_error(run)
        assert err.where.endswith("tokenizer_config.json")
        assert "refused" in err.problem, err.problem
