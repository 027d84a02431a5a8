"""Qwen3.5 and Qwen3.5-MoE GGUF files: export then import gives back the source's tensors; the
files llama.cpp's converter writes beside ours (an older one without per-layer flags, one with a
multi-token-prediction block) import as the same model; and a model llama.cpp would load or
compute otherwise is refused before anything is written.

transformers' GGUF reader is the reference in test_gguf.py, llama.cpp in test_llama_cpp.py.
"""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.exporter import export_gguf
from slideformer.engine.gguf.importer import import_gguf
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.tokenizer import load_tokenizer
from tests.engine.gguf.test_gguf import QWEN35

ARCHS = ["qwen3_5_text", "qwen3_5_moe_text"]
F32_MATRICES = ("mlp.gate.weight", "shared_expert_gate.weight")
"""Matrices an f16 export keeps in F32 as llama.cpp's converter does (with the convolution,
3-D on disk)."""


def stored(t: torch.Tensor, name: str, kind: str) -> torch.Tensor:
    """What the file holds of source tensor ``name``, as import writes it (bf16)."""
    if kind == "f16" and t.ndim == 2 and not name.endswith(F32_MATRICES):
        t = t.to(torch.float16)
    return t.to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_export_then_import_gives_back_the_tensors(arch, kind, tiny_model_factory, tmp_path):
    src = tiny_model_factory(arch, TinyShape(), QWEN35, seed=3)
    out = import_gguf(export_gguf(src, tmp_path / "m.gguf", kind), tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:  # the value heads reordered and back, conv squeezed, 1 + w, -exp(A_log)
        assert torch.equal(stored(a[k], k, kind), b[k]), k
    cfg, back = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for key in ("layer_types", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "rope_parameters", "num_experts", "moe_intermediate_size",
                "shared_expert_intermediate_size"):
        assert back.get(key) == cfg.get(key), key


def rewrite(src, dst, drop=(), add=None, tensors=None):
    """A copy of GGUF file ``src`` without the keys ``drop``, with ``add`` (key -> (value,
    type); an array holds booleans) and extra ``tensors`` (name -> fp32 array)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in (*drop, "general.architecture"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in (add or {}).items():
        sub = gguf.GGUFValueType.BOOL if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, data in (tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_older_files_and_the_mtp_block_import_as_the_same_model(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen3_5_text", TinyShape(), QWEN35, seed=3)
    f = export_gguf(src, tmp_path / "m.gguf", "f32")
    plain = load_file(str(import_gguf(f, tmp_path / "plain") / "model.safetensors"))
    arch, V = "qwen35", gguf.GGUFValueType
    # llama.cpp before per-layer flags: every full_attention_interval-th layer is full
    older = rewrite(f, tmp_path / "older.gguf", drop=[f"{arch}.attention.recurrent_layers"])
    # the converter's default: the MTP block appended as blk.4, counted in block_count
    mtp = rewrite(f, tmp_path / "mtp.gguf",
                  drop=[f"{arch}.block_count", f"{arch}.attention.recurrent_layers"],
                  add={f"{arch}.block_count": (5, V.UINT32),
                       f"{arch}.nextn_predict_layers": (1, V.UINT32),
                       f"{arch}.attention.recurrent_layers": ([True] * 3 + [False] * 2, V.ARRAY)},
                  tensors={"blk.4.nextn.eh_proj.weight": np.zeros((96, 192), np.float32),
                           "blk.4.attn_norm.weight": np.ones(96, np.float32)})
    for name, file in (("older", older), ("mtp", mtp)):
        out = import_gguf(file, tmp_path / name)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["num_hidden_layers"] == 4 and cfg["layer_types"] == (
            ["linear_attention"] * 3 + ["full_attention"]), name
        got = load_file(str(out / "model.safetensors"))
        assert set(got) == set(plain) and all(torch.equal(got[k], plain[k]) for k in got), name
    stray = rewrite(f, tmp_path / "stray.gguf", tensors={"blk.4.attn_norm.weight": np.ones(96, np.float32)})
    with pytest.raises(UserError, match="does not use: blk.4.attn_norm.weight"):
        import_gguf(stray, tmp_path / "stray")


@pytest.mark.parametrize("extra, match", [
    ({"linear_value_head_dim": 12}, "sizes both by one number"),
    (QWEN35 | {"rope_parameters": QWEN35["rope_parameters"] | {"mrope_section": [0, 1, 0]}},
     r"leave rotary pairs \[0, 1\] unrotated"),
    (QWEN35 | {"rope_parameters": QWEN35["rope_parameters"] | {"mrope_section": [11, 11, 10]}},
     "whose sum is not in 1..16"),
])
def test_a_model_llama_cpp_would_not_compute_is_refused(extra, match, tiny_model_factory,
                                                         tmp_path):
    folder = tiny_model_factory("qwen3_5_text", TinyShape(), extra, seed=3)
    with pytest.raises(UserError, match=match):
        export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert not list(tmp_path.iterdir())


MARKS = "Cafe\u0301 nai\u0308ve 12 + 3 = 15, \u00e0 la Zoe\u0308\u0301!"
"""Text whose combining marks (U+0301, U+0308) Qwen3.5's split keeps with their letters and
Qwen2's splits off."""


def qwen35_tokenizer_folder(src, out):
    """A copy of tiny model folder ``src`` whose tokenizer splits text as Qwen3.5's does."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    shutil.copytree(src, out)
    tj = json.loads((out / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": PRETOKENIZE_REGEX}
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def test_qwen35_pre_tokenizer_round_trips(tiny_model_factory, tmp_path):
    from transformers import AutoTokenizer
    src = tiny_model_factory("qwen3_5_text", TinyShape(), QWEN35, seed=3)
    folder = qwen35_tokenizer_folder(src, tmp_path / "src")
    f = export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert gguf.GGUFReader(f).fields["tokenizer.ggml.pre"].contents() == "qwen35"
    ours = load_tokenizer(import_gguf(f, tmp_path / "back"))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=f.name)
    source, qwen2 = load_tokenizer(folder), load_tokenizer(src)
    assert ours.encode(MARKS) == source.encode(MARKS) == theirs.encode(MARKS, add_special_tokens=False)
    split = lambda tok: tok.tok.pre_tokenizer.pre_tokenize_str(MARKS)  # noqa: E731
    assert split(ours) == split(source) != split(qwen2)  # (the tiny merges see bytes alike)
