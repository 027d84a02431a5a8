"""Tokenizer loading and the sandboxed chat template, against transformers' tokenizer."""
from __future__ import annotations

import json
import shutil

import pytest
from jinja2.exceptions import SecurityError

from slideformer.engine.errors import UserError
from slideformer.engine.models.tiny import BOS, EOS, IM_START, PAD
from slideformer.engine.models.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"}]
TEXTS = ["Hello world 12 + 3 = 15.", "  leading spaces\nand\ttabs", "héllo wörld ✓ 中文",
         f"{IM_START}user\nhi{EOS}"]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def hf_tokenizer(tiny):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny)


def with_template(src, dst, template):
    """A copy of the model folder ``src`` whose tokenizer_config.json has ``template``."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return dst


def test_special_tokens(tiny, hf_tokenizer):
    tok = load_tokenizer(tiny)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id)
    assert len({tok.bos_id, tok.eos_id, tok.pad_id, tok.token_id(IM_START)}) == 4
    # each special token is one token, also inside text
    assert tok.encode(f"a{IM_START}b{EOS}") == (
        tok.encode("a") + [tok.token_id(IM_START)] + tok.encode("b") + [tok.eos_id])


def test_pad_falls_back_to_eos(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "m")
    cfg_path = tmp_path / "m" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["pad_token"]
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path / "m")
    assert tok.pad_token is None and tok.pad_id == tok.eos_id


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(text, tiny, hf_tokenizer):
    tok = load_tokenizer(tiny)
    ids = tok.encode(text)
    assert ids == hf_tokenizer(text, add_special_tokens=False).input_ids
    assert tok.tok.encode(text).ids == hf_tokenizer(text).input_ids == [tok.bos_id] + ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_renders_like_transformers(gen, tiny, hf_tokenizer):
    got = load_tokenizer(tiny).render_chat(MESSAGES, add_generation_prompt=gen)
    assert got == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                   add_generation_prompt=gen)
    assert got.startswith(f"{BOS}{IM_START}system\nBe brief.{EOS}\n{IM_START}user\n")
    prompt = f"{IM_START}assistant\n" if gen else ""
    assert got.endswith(f"{IM_START}assistant\n5{EOS}\n{prompt}")


def test_template_features_of_real_models(tiny, tmp_path, hf_tokenizer):
    """namespace, loop controls, tojson, strftime_now, raise_exception, as in Llama 3.x / Qwen."""
    template = (
        "{% set ns = namespace(users=0) %}"
        "{% for m in messages %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "{% if m['role'] == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m | tojson }}\n"
        "{% endfor %}"
        "users={{ ns.users }} year={{ strftime_now('%Y') | length }}")
    folder = with_template(tiny, tmp_path / "m", template)
    tok = load_tokenizer(folder)
    assert tok.render_chat(MESSAGES) == hf_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, chat_template=template)
    with pytest.raises(UserError, match="bad role tool") as e:
        tok.render_chat([{"role": "tool", "content": "x"}])
    assert e.value.where.endswith("tokenizer_config.json")


def test_template_from_transformers_save(tiny, tmp_path, hf_tokenizer):
    """transformers >= 4.47 saves the template to chat_template.jinja, not tokenizer_config.json."""
    hf_tokenizer.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.render_chat(MESSAGES) == load_tokenizer(tiny).render_chat(MESSAGES)


# Sizes are past the sandbox's caps but small enough that a missing guard fails the test
# instead of hanging or exhausting memory.
HOSTILE = [
    pytest.param("{{ ''.__class__.__mro__[1].__subclasses__() }}", SecurityError,
                 id="class-mro-subclasses"),
    pytest.param("{{ raise_exception.__globals__['os'].system('id') }}", SecurityError,
                 id="function-globals-os"),
    pytest.param("{{ cycler.__init__.__globals__.os.popen('id').read() }}", SecurityError,
                 id="cycler-init-globals-os"),
    pytest.param("{{ messages.append({'role': 'user'}) }}", SecurityError,
                 id="mutate-messages"),
    pytest.param("{% for i in range(10**9) %}{% endfor %}", OverflowError, id="huge-range"),
    pytest.param("{{ 'x' * 10**7 }}", SecurityError, id="string-repetition"),
    pytest.param("{{ 9 ** (10**6) }}", SecurityError, id="integer-power"),
    pytest.param("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", RecursionError,
                 id="recursive-macro"),
    pytest.param("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
                 RecursionError, id="recursive-loop"),
]


@pytest.mark.parametrize("template,refusal", HOSTILE)
def test_hostile_template_is_refused(template, refusal, tiny, tmp_path):
    tok = load_tokenizer(with_template(tiny, tmp_path / "m", template))
    with pytest.raises(UserError, match="refused") as e:
        tok.render_chat(MESSAGES)
    assert e.value.where.endswith("tokenizer_config.json")
    assert "fix:" in str(e.value)
    # the refusal came from the sandbox (or the recursion guard), not from some other failure
    assert isinstance(e.value.__context__, refusal)


@pytest.mark.parametrize("template", [
    "{% if %}", "{{ undefined_name.attr }}", "{{ 1 + 'a' }}", "{{ 1 / 0 }}", "{{ 2 ** 15000 }}"])
def test_broken_template_is_a_user_error(template, tiny, tmp_path):
    tok = load_tokenizer(with_template(tiny, tmp_path / "m", template))
    with pytest.raises(UserError, match="chat_template failed") as e:
        tok.render_chat(MESSAGES)
    assert e.value.where.endswith("tokenizer_config.json")


def test_missing_tokenizer_json(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="is missing") as e:
        load_tokenizer(tmp_path / "m")
    assert e.value.where.endswith("tokenizer.json")
