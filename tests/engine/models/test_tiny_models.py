"""Tiny models are fixtures for real families: transformers must see them as that family's."""
import pytest

from slideformer.engine.models.spec import SUPPORTED
from slideformer.engine.models.tiny import FAMILY_TOKENS
from slideformer.engine.models.tokenizer import load_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("arch", SUPPORTED)
def test_transformers_loads_each_tiny_tokenizer_as_its_family(arch, tiny_model_factory):
    from transformers import AutoConfig, AutoTokenizer

    folder = tiny_model_factory(arch)
    hf = AutoTokenizer.from_pretrained(folder)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    assert len(hf) <= vocab, f"{type(hf).__name__} added {sorted(hf.get_added_vocab())}"
    tokens = FAMILY_TOKENS[arch]
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (tokens.bos, tokens.eos, tokens.pad)
    assert set(hf.all_special_tokens) <= set(tokens.specials)
    text = hf.apply_chat_template(CHAT, tokenize=False)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < vocab and hf.decode(ids) == text
    assert "4" + tokens.eos in text  # the assistant turn ends with the family's eos
    ours = load_tokenizer(folder)  # the engine renders and encodes as transformers does
    assert ours.render_chat(CHAT) == text
    assert ours.encode(text) == ids  # the template wrote the bos token already
