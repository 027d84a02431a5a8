"""The real Gemma 3 270M (Q4_K_M GGUF from its pip packages) imported: its SentencePiece
tokenizer encodes as transformers' GGUF tokenizer does, and the imported folder's logits are
transformers' logits of the same folder (and, within bf16 rounding, of the GGUF file itself).
Skipped where the packages are not installed (``slideformer import-gguf --help`` says how)."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.gguf.importer import import_gguf
from slideformer.engine.gguf.installed import gemma3_gguf
from slideformer.engine.models.tiny import synthetic_corpus
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.engine.errors import UserError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    try:
        f = gemma3_gguf(root / "cache")
    except UserError as e:
        pytest.skip(str(e))
    return f, import_gguf(f, root / "model")


def test_tokenizer_encodes_like_transformers(gemma):
    from transformers import AutoTokenizer
    f, folder = gemma
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    texts = synthetic_corpus(50) + ["  spaces   and\ttabs, émojis 🤗 1234567",
                                    "<start_of_turn>user\nhi<end_of_turn>\n", "日本語のテキスト"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


def test_logits_match_transformers(gemma, load_dense):
    from transformers import AutoModelForCausalLM
    f, folder = gemma
    ids = torch.tensor([[2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107]])
    ours = load_dense(folder)
    same = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours.logits(ids), same(input_ids=ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
    file = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
    with torch.no_grad():
        c = file.eval()(input_ids=ids).logits  # fp32 dequantised: our folder holds bf16
    assert ((a - c).abs().max() / c.abs().max()).item() < 2e-2
    assert torch.equal(a[0].argmax(-1), c[0].argmax(-1))
