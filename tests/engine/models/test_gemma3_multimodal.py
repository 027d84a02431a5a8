"""The text tower of a multimodal Gemma 3 folder (``model_type`` "gemma3": 4B, 12B, 27B), as
transformers saves one: read under its prefix with Gemma3TextConfig's defaults, equal to
transformers' Gemma3ForConditionalGeneration on text, exported as a Gemma3ForCausalLM."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec, spec_from_config
from slideformer.engine.models.weights import TOKENIZER_FILES, item_names, write_hf_folder
from slideformer.engine.models.tiny import TinyShape

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def multimodal(tiny_model_factory, tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (a one-layer SigLIP tower) saved by transformers,
    with the tiny Gemma 3 tokenizer."""
    src = tiny_model_factory("gemma3_text", TinyShape())
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text),
                                    vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=text["vocab_size"] - 1)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gemma3-mm") / "model"
    transformers.Gemma3ForConditionalGeneration(cfg).eval().save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, out / f)
    return out


def test_text_tower_logits_equal_transformers(multimodal, load_dense):
    assert json.loads((multimodal / "config.json").read_text())["model_type"] == "gemma3"
    ours = load_dense(multimodal)
    assert ours.spec.model_type == "gemma3_text" and ours.spec.tie_word_embeddings
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        multimodal, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours.logits(ids), ref(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_export_is_a_text_only_gemma3(multimodal, load_dense, tmp_path):
    model = load_dense(multimodal)
    tensors = ((name, t) for item, flat, layout in model.items()
               for name, t in _named(model.spec, item, layout.views(flat)))
    out = write_hf_folder(tmp_path / "out", model.spec, tensors, dtype=torch.float32,
                          tokenizer_dir=multimodal)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ids = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model.logits(ids), ref(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def _named(spec, item, views):
    from slideformer.engine.models.weights import stored_views
    return stored_views(spec, item, views)


def test_defaults_fill_what_the_released_configs_leave_out():
    """google/gemma-3-4b-it's text_config names only sizes, layers, window and RoPE scaling."""
    spec = spec_from_config({"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}})
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (8, 4, 256, 262208)
    assert spec.tie_word_embeddings and spec.torch_dtype == "bfloat16"
    assert spec.layer_types.count("full_attention") == 5 and spec.sliding_window == 1024
    assert spec.rope_scaling == (("factor", 8.0), ("rope_type", "linear"))
    assert spec.local_rope == (10000.0, None)


def test_a_multimodal_config_without_text_config_is_refused(tmp_path):
    with pytest.raises(UserError, match="without a 'text_config'"):
        spec_from_config({"model_type": "gemma3"}, tmp_path / "config.json")
