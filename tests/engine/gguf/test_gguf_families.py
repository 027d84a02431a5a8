"""GGUF export and import of Phi-3 (with Phi-4-mini's partial rotary and LongRoPE), OLMo 2,
OLMo 3, SmolLM3, Mixtral and Gemma 4 (dense, with experts, with and without keys as values),
and of YaRN RoPE scaling: our import of our export is the same
model (the same tensors, config and logits), and a model llama.cpp would compute otherwise is
refused before anything is written, naming config.json and the key.

llama.cpp's own reading of these files is tested in test_llama_cpp.py.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.exporter import export_gguf
from slideformer.engine.gguf.header import read_header
from slideformer.engine.gguf.importer import import_gguf, importable
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape

PHI4_MINI = {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024,
             "rope_scaling": {"rope_type": "longrope",
                              "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 4.5],
                              "long_factor": [1.5, 2.5, 4.0, 8.0, 16.0, 24.0]}}
"""Phi-4-mini's RoPE on the tiny model: the first 3/4 of each head turned (6 of 8 pairs),
LongRoPE factors per pair, an original context of 1024 of the 2048 (attention factor
sqrt(1 + ln 2 / ln 1024), derived)."""
OLMO3 = {"rope_theta": 500000.0}
"""An OLMo 3 whose full and sliding layers turn by one RoPE base, as llama.cpp computes them
(Olmo3Config gives the sliding layers 500000 unless rope_parameters names theirs)."""
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
"""YaRN as OLMo 3's releases (and Qwen's long-context configs) set it, on the tiny model's 2048
positions: truncated correction range, beta_fast 32, beta_slow 1."""
YARN_MODELS = {"olmo3": OLMO3 | {"rope_scaling": YARN},
               "qwen3": {"rope_scaling": YARN | {"attention_factor": 1.5}},
               "llama": {"rope_scaling": YARN}, "qwen2": {"rope_scaling": YARN},
               "qwen3_moe": {"rope_scaling": YARN}, "smollm3": {"rope_scaling": YARN}}
"""Families whose GGUF carries YaRN: config.json keys over the tiny model (one with an
attention factor of its own, which llama.cpp takes as a multiple of its default)."""
GEMMA4_V_PROJ = {"attention_k_eq_v": False, "rope_parameters": {
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0,
                       "rope_theta": 100000.0}}}
"""Gemma 4 with a v_proj on the full layers (keys as values off: their KV heads are the sliding
layers'), RoPE bases of its own and a proportional RoPE turning half of the pairs, scaled x2."""
GEMMA4 = {"gemma4": (TinyShape(), None), "gemma4-moe": (TinyShape(), {"enable_moe_block": True}),
          "gemma4-v_proj": (TinyShape(tie=True), GEMMA4_V_PROJ)}
"""Test id -> (shape, config.json keys) of the tiny Gemma 4 models (test_models.py's variants:
sliding and full layers alternate, the full ones with a head size and KV heads of their own)."""
CASES = {"phi3": ("phi3", None), "phi4-mini": ("phi3", PHI4_MINI), "olmo2": ("olmo2", None),
         "olmo3": ("olmo3", OLMO3), "smollm3": ("smollm3", None), "mixtral": ("mixtral", None),
         "olmoe": ("olmoe", {"num_key_value_heads": 6}),
         "olmo3-yarn": ("olmo3", YARN_MODELS["olmo3"]),
         "qwen3-yarn": ("qwen3", YARN_MODELS["qwen3"])}
"""Test id -> (family, config.json keys over its tiny model)."""
SHARPNESS = 4.0


def sharpened(folder, out, scale: float = SHARPNESS):
    """A copy of model folder ``folder`` whose q and k projections are ``scale`` times larger.

    The tiny models' attention is nearly uniform (N(0, 0.02) weights), so how a position is
    turned barely moves their logits: llama.cpp without LongRoPE's attention factor, or with
    RoPE in SmolLM3's NoPE layer, stayed within 2e-3 of transformers. Scaled by 4 the scores
    matter: those mistakes move the logits by 3e-2 and more, the right file by 3e-4 (measured).
    (OLMo's q/k norms undo the scale: its scores are of order 1 anyway.)"""
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        if any(f"self_attn.{p}." in name for p in ("q_proj", "k_proj", "qkv_proj")):
            tensors[name] = t * scale  # (v too, in Phi-3's fused matrix: any scale will do)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def logits(folder, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


@pytest.mark.parametrize("case", [*CASES, *GEMMA4])
def test_import_of_our_export_is_the_same_model(case, tiny_model_factory, tmp_path):
    pytest.importorskip("transformers")
    arch, shape, extra = ("gemma4_text", *GEMMA4[case]) if case in GEMMA4 else \
        (CASES[case][0], TinyShape(), CASES[case][1])
    src = tiny_model_factory(arch, shape, extra, seed=2)
    f = export_gguf(src, tmp_path / "m.gguf", "f32")
    back = import_gguf(f, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:  # Q/K rows reordered and back (SmolLM3, Mixtral); experts split per expert
        assert torch.equal(a[k].to(torch.bfloat16), b[k]), k
    ours, theirs = load_spec(src), load_spec(back)
    assert dataclasses.replace(theirs, torch_dtype=ours.torch_dtype) == ours
    ids = [5, 17, 300, 42, 9, 250, 77, 3, 120, 64, 33, 200]
    assert torch.equal(logits(src, ids), logits(back, ids))


def test_longrope_is_read_back_from_the_file_and_listed_from_its_header(tiny_model_factory,
                                                                         tmp_path):
    src = tiny_model_factory("phi3", TinyShape(), PHI4_MINI, seed=2)
    f = export_gguf(src, tmp_path / "m.gguf", "q8_0")
    r = gguf.GGUFReader(f)
    assert [float(x) for x in r.get_tensor(  # written as llama.cpp's converter writes them
        [t.name for t in r.tensors].index("rope_factors_short.weight")).data] == \
        PHI4_MINI["rope_scaling"]["short_factor"]
    assert r.fields["phi3.rope.scaling.original_context_length"].contents() == 1024
    assert r.fields["phi3.rope.dimension_count"].contents() == 12
    cfg = json.loads((import_gguf(f, tmp_path / "back") / "config.json").read_text())
    assert cfg["partial_rotary_factor"] == 0.75 and cfg["original_max_position_embeddings"] == 1024
    assert {k: cfg["rope_scaling"][k] for k in ("short_factor", "long_factor")} == \
        {k: PHI4_MINI["rope_scaling"][k] for k in ("short_factor", "long_factor")}
    listed = importable(read_header(f))  # no tensor data read: the factors' shapes only
    assert listed.rotary_dim == 12 and dict(listed.rope_scaling)["rope_type"] == "longrope"


def test_an_explicit_longrope_attention_factor_survives(tiny_model_factory, tmp_path):
    extra = {**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "attention_factor": 1.25}}
    src = tiny_model_factory("phi3", TinyShape(), extra, seed=2)
    f = export_gguf(src, tmp_path / "m.gguf", "f32")
    assert gguf.GGUFReader(f).fields["phi3.rope.scaling.attn_factor"].contents() == 1.25
    back = load_spec(import_gguf(f, tmp_path / "back"))
    assert dict(back.rope_scaling)["attention_factor"] == 1.25


def test_a_mixtral_named_mistral_imports_as_mixtral(tiny_model_factory, tmp_path):
    """Mixtral and Mistral are both llama.cpp's ``llama``: the experts decide before the name."""
    src = shutil.copytree(tiny_model_factory("mixtral", TinyShape(), seed=2),
                          tmp_path / "mistral-moe")
    f = export_gguf(src, tmp_path / "m.gguf", "f32")
    assert gguf.GGUFReader(f).fields["general.name"].contents() == "mistral-moe"
    cfg = json.loads((import_gguf(f, tmp_path / "back") / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4


def test_a_one_layer_gemma4_is_refused(tiny_model_factory, tmp_path):
    """llama.cpp's gemma4 stops with an assertion on a one-layer model (its KV cache)."""
    folder = tiny_model_factory("gemma4_text", TinyShape(layers=1), seed=2)
    with pytest.raises(UserError, match="num_hidden_layers = 1") as e:
        export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert e.value.where == str(folder / "config.json") and not list(tmp_path.iterdir())


def test_gemma4_is_written_as_llama_cpp_reads_it(tiny_model_factory, tmp_path):
    """The keys and tensors llama.cpp's gemma4 reads (src/models/gemma4.cpp): the full layers'
    head size and the sliding layers' apart, KV heads per layer, which layers slide, the
    proportional RoPE as rope_freqs (1 for the pairs that turn, 1e30 for the others), the
    layer scalars and the routers' scales under the converter's names."""
    f = export_gguf(tiny_model_factory("gemma4_text", *GEMMA4["gemma4-moe"], seed=2),
                    tmp_path / "m.gguf", "q8_0")
    r = gguf.GGUFReader(f)
    field = lambda key: r.fields[f"gemma4.{key}"].contents()  # noqa: E731
    assert (field("attention.key_length"), field("attention.key_length_swa")) == (32, 16)
    assert (field("rope.dimension_count"), field("rope.dimension_count_swa")) == (32, 16)
    assert field("attention.head_count_kv") == [2, 1, 2, 1]
    assert field("attention.sliding_window_pattern") == [True, False, True, False]
    assert (field("rope.freq_base"), field("rope.freq_base_swa")) == (1e6, 1e4)
    assert field("final_logit_softcapping") == 0.5 and field("attention.sliding_window") == 8
    tensors = {t.name: t for t in r.tensors}
    assert tensors["rope_freqs.weight"].data.tolist() == np.array([1.0] * 4 + [1e30] * 12,
                                                                  np.float32).tolist()
    assert "blk.1.attn_v.weight" not in tensors and "blk.0.attn_v.weight" in tensors
    for name in ("blk.0.layer_output_scale.weight", "blk.0.ffn_gate_inp.scale",
                 "blk.0.ffn_down_exps.scale", "blk.0.ffn_gate_up_exps.weight"):
        assert name in tensors, name
    listed = importable(read_header(f))  # the header alone: shapes, heads, layer types
    assert listed.attn_shapes == ((16, 2), (32, 1), (16, 2), (32, 1)) and listed.moe.experts == 4


@pytest.mark.parametrize("arch, extra, match", [
    # Phi-3-mini-4k's window: llama.cpp disables Phi's sliding window
    ("phi3", {"sliding_window": 2047}, r"sliding_window 2047, shorter than "
                                       r"max_position_embeddings 2048"),
    ("phi3", {"head_dim": 32}, "head_dim 32, and 6 heads of it are not hidden_size 96"),
    ("phi3", {"attention_bias": True}, "attention_bias = true"),
    ("olmo2", {"mlp_bias": True}, "mlp_bias = true"),
    ("olmo2", {"tie_word_embeddings": True}, "tie_word_embeddings = true"),
    ("olmo3", None, "RoPE base of 500000 and the full_attention layers 10000"),
    ("olmo3", {**OLMO3, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}},
     "RoPE scaling for the sliding_attention layers"),
    ("smollm3", {"no_rope_layer_interval": 2}, r"no RoPE in layers \[1, 3\] \(no_rope_layers\)"),
    ("olmo2", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 512}},
     "rope_scaling of type 'llama3'"),
    # GPT-OSS's YaRN: llama.cpp always rounds the correction range
    ("smollm3", {"rope_scaling": YARN | {"truncate": False}}, "rope_scaling.truncate = false"),
    ("qwen2", {"rope_scaling": YARN | {"beta_fast": 16.0}}, "rope_scaling.beta_fast = 16.0"),
    ("mixtral", {"sliding_window": 16}, "sliding_window 16, shorter than"),
    ("olmoe", {"num_key_value_heads": 2}, "sizes the key norm by hidden_size"),
    ("olmoe", {"norm_topk_prob": True, "num_key_value_heads": 6}, "never renormalises"),
    ("qwen3_moe", {"norm_topk_prob": False}, "always renormalises"),
    # Gemma 4: llama.cpp turns the sliding layers unscaled, by the neox RoPE (or proportional)
    ("gemma4_text", {"rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1e6}}},
     r"RoPE scaling for the sliding_attention layers \(rope_parameters.sliding_attention\)"),
    ("gemma4_text", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": YARN | {"rope_theta": 1e6}}},
     "rope_parameters.full_attention of type 'yarn'"),
    ("gemma4_text", {"per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 48}}},
     r"full_attention layers head sizes \[32, 48\] \(per_layer_config\)"),
    ("gemma4_text", {"attention_bias": True}, "attention_bias = true"),
])
def test_a_model_llama_cpp_would_compute_otherwise_is_refused(arch, extra, match,
                                                              tiny_model_factory, tmp_path):
    folder = tiny_model_factory(arch, TinyShape(), extra, seed=2)
    with pytest.raises(UserError, match=match) as e:
        export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert e.value.where == str(folder / "config.json") and e.value.fix
    assert not list(tmp_path.iterdir())  # nothing written, not even a partial file
