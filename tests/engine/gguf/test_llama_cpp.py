"""The GGUF files we write, loaded by llama.cpp itself (llama-cpp-python): the same token ids as
our tokenizer and the same logits as transformers, for every family llama.cpp has; for Qwen3.5,
Phi-4-mini's RoPE (partial, LongRoPE) and Gemma 4 the same greedy tokens from an f16 file as
transformers from the folder; LongRoPE's long factors where llama.cpp's context passes the
original one; YaRN as transformers computes it; and a LoRA adapter GGUF applied by llama.cpp
equals the merged model.

llama-cpp-python builds llama.cpp from source (minutes), so it is not a test dependency: these
tests skip where it is not installed.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

from slideformer.engine.gguf.exporter import export_gguf  # noqa: E402
from slideformer.engine.gguf.lora_adapter import export_lora_gguf  # noqa: E402
from slideformer.engine.models.lora import LoraSpec  # noqa: E402
from slideformer.engine.models.tiny import TinyShape  # noqa: E402
from slideformer.engine.models.tokenizer import load_tokenizer  # noqa: E402
from tests.engine.gguf.test_gguf import QWEN35  # noqa: E402
from tests.engine.gguf.test_gguf_families import (GEMMA4, OLMO3, PHI4_MINI,  # noqa: E402
                                                   YARN_MODELS, sharpened)
from tests.engine.gguf.test_gguf_lora import TARGETS, merged_folder, write_peft_adapter  # noqa: E402
from tests.engine.gguf.test_gguf_qwen35 import MARKS, qwen35_tokenizer_folder  # noqa: E402

TEXT = "hello world, this is a test 123 of the tokenizer"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "qwen3_5_text",
            "qwen3_5_moe_text", "phi3", "olmo2", "olmo3", "smollm3", "mixtral", "olmoe"]
GEMMA3 = {"layer_types": ["sliding_attention"] * 5 + ["full_attention"], "sliding_window": 8,
          "query_pre_attn_scalar": 16}
"""A Gemma 3 as llama.cpp computes one: every sixth layer global, scores by head_dim ** -0.5."""
MODELS = {"gemma3_text": (TinyShape(layers=6), GEMMA3), "qwen3_5_text": (TinyShape(), QWEN35),
          "qwen3_5_moe_text": (TinyShape(), QWEN35), "phi3": (TinyShape(), PHI4_MINI),
          "olmo3": (TinyShape(), OLMO3), "olmoe": (TinyShape(kv_heads=6), None)}
"""Families whose tiny model is shaped for llama.cpp: (shape, config.json keys over it)."""
SHARP = ("phi3", "smollm3", "mixtral")
"""Families tested with their q and k scaled up (test_gguf_families.sharpened), so that how a
position turns decides the logits: Phi-3's partial LongRoPE, SmolLM3's NoPE layer. (OLMo's q/k
norms give it scores of order 1 as it is: without its window llama.cpp is 1.4 off.)"""
N_CTX = 128
"""llama.cpp's context: within PHI4_MINI's original 1024, so llama.cpp turns by the short
factors, as transformers does for these short sequences."""
GREEDY = 32
"""Greedy tokens compared. The smallest gap between transformers' two best logits on these
models is 1.1e-3 (Qwen3.5), 8.1e-3 (MoE) and 9.9e-4 (Phi-4-mini's RoPE), of logits up to 0.84;
llama.cpp's f16 logits are within 4.7e-4 (Phi-3: 5.2e-4) of transformers' (measured). Gemma 4
(f16 file, f16 cache): smallest gaps 8.1e-4 (dense), 2.8e-4 (experts), 2.4e-3 (v_proj), of
logits capped at 0.5; 32 of 32 equal for each (measured)."""
TOL = 2e-3
"""llama.cpp's logits against transformers' (fp32 weights), relative to the largest logit:
measured 3e-4 to 1e-3 on these models (its KV cache is f16)."""
F32_CACHE = {"type_k": 0, "type_v": 0}
"""llama.cpp's KV cache in f32 (GGML_TYPE_F32): Gemma 4's scores are not scaled (q and k are
RMS-normed, so a score is of order sqrt(head_dim)), and its f16 cache moves the tiny models'
logits by 4.4e-3 to 7.7e-3 of the largest, all of it rounding (f32 cache: 2.0e-3 to 2.4e-3;
the largest is the soft cap's 0.47, not the raw logits')."""
GEMMA4_TOL = 4e-3
"""Gemma 4's tolerance with the f32 cache. Mistakes move these logits far more (measured): the
full layers' RoPE without the proportional rule 0.22, the sliding layers turned by the full
layers' base 1.04, no window 1.49."""


def llama_logits(path, ids: list[int], n_ctx: int = N_CTX, **params) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=n_ctx,
                          n_threads=2, **params)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def hf_logits(folder, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("arch", FAMILIES)
def test_llama_cpp_reads_our_gguf_as_transformers_reads_the_folder(arch, tiny_model_factory,
                                                                   tmp_path):
    folder = model_folder(arch, tiny_model_factory, tmp_path)
    out = export_gguf(folder, tmp_path / "m.gguf", "f32")
    tok = load_tokenizer(folder)
    ids = tok.tok.encode(TEXT, add_special_tokens=True).ids
    llm = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    assert llm.tokenize(TEXT.encode(), add_bos=tok.bos_id is not None and ids[0] == tok.bos_id,
                        special=False) == ids
    got, ref = llama_logits(out, ids), hf_logits(folder, ids)
    assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()


@pytest.mark.parametrize("case", list(GEMMA4))
def test_llama_cpp_computes_gemma4_as_transformers(case, tiny_model_factory, tmp_path):
    """Heads of two sizes, keys as values (and not), the value norm, proportional RoPE (scaled),
    layer scalars, soft-capped logits, experts beside the MLP: llama.cpp's gemma4 reads the
    layer pattern from the file, so the tiny models need no shaping."""
    folder = model_folder(case, tiny_model_factory, tmp_path)
    out = export_gguf(folder, tmp_path / "m.gguf", "f32")
    ids = load_tokenizer(folder).tok.encode(TEXT, add_special_tokens=True).ids
    llm = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    assert llm.tokenize(TEXT.encode(), add_bos=True, special=False) == ids
    got, ref = llama_logits(out, ids, **F32_CACHE), hf_logits(folder, ids)
    assert np.abs(got - ref).max() <= GEMMA4_TOL * np.abs(ref).max()


def model_folder(arch: str, tiny_model_factory, tmp_path):
    """The tiny model of ``arch`` as MODELS shapes it, sharpened for the SHARP families (a
    Gemma 4 test id: test_gguf_families.GEMMA4's model)."""
    if arch in GEMMA4:
        return tiny_model_factory("gemma4_text", *GEMMA4[arch], seed=2)
    folder = tiny_model_factory(arch, *MODELS.get(arch, (TinyShape(), None)), seed=2)
    return sharpened(folder, tmp_path / "sharp") if arch in SHARP else folder


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5_moe_text", "phi3", "olmoe", *GEMMA4])
def test_llama_cpp_greedy_tokens_equal_transformers(arch, tiny_model_factory, tmp_path):
    folder = model_folder(arch, tiny_model_factory, tmp_path)
    out = export_gguf(folder, tmp_path / "m.gguf", "f16")
    ids = load_tokenizer(folder).tok.encode(TEXT, add_special_tokens=True).ids
    llm = llama_cpp.Llama(model_path=str(out), logits_all=True, verbose=False, n_ctx=N_CTX,
                          n_threads=2)
    llm.eval(ids)
    got = []  # one token at a time: the DeltaNet state and the KV cache carry the context
    for _ in range(GREEDY):
        got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(got[-1:])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = list(ids)
    with torch.no_grad():  # the whole sequence every step, no cache
        for _ in range(GREEDY):
            ref.append(int(model(torch.tensor([ref])).logits[0, -1].argmax()))
    assert got == ref[len(ids):]


def test_llama_cpp_turns_by_the_long_factors_past_the_original_context(tiny_model_factory,
                                                                      tmp_path):
    """llama.cpp picks LongRoPE's factors by its context size (n_ctx 2048 > the original 1024:
    the long ones) where transformers picks them by the positions: llama.cpp's logits are then
    those transformers computes with the long factors in place of the short ones."""
    folder = model_folder("phi3", tiny_model_factory, tmp_path)
    out = export_gguf(folder, tmp_path / "m.gguf", "f32")
    long = shutil.copytree(folder, tmp_path / "long")
    cfg = json.loads((long / "config.json").read_text())
    cfg["rope_scaling"]["short_factor"] = cfg["rope_scaling"]["long_factor"]
    (long / "config.json").write_text(json.dumps(cfg))
    ids = load_tokenizer(folder).tok.encode(TEXT, add_special_tokens=True).ids
    got, ref = llama_logits(out, ids, n_ctx=2048), hf_logits(long, ids)
    assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()
    assert np.abs(got - hf_logits(folder, ids)).max() > 10 * TOL * np.abs(ref).max()


@pytest.mark.parametrize("arch", list(YARN_MODELS))
def test_llama_cpp_computes_yarn_as_transformers(arch, tiny_model_factory, tmp_path):
    folder = tiny_model_factory(arch, TinyShape(), YARN_MODELS[arch], seed=2)
    folder = sharpened(folder, tmp_path / "sharp")  # without YaRN: 6e-2 to 1.4 apart (measured)
    out = export_gguf(folder, tmp_path / "m.gguf", "f32")
    ids = load_tokenizer(folder).tok.encode(TEXT, add_special_tokens=True).ids
    got, ref = llama_logits(out, ids), hf_logits(folder, ids)
    assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()


def test_llama_cpp_reads_the_qwen35_pre_tokenizer(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen3_5_text", *MODELS["qwen3_5_text"], seed=2)
    folder = qwen35_tokenizer_folder(src, tmp_path / "src")
    llm = llama_cpp.Llama(model_path=str(export_gguf(folder, tmp_path / "m.gguf", "f32")),
                          vocab_only=True, verbose=False)  # an unknown name fails to load
    for text in (TEXT, MARKS):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == \
            load_tokenizer(folder).tok.encode(text, add_special_tokens=False).ids


def test_a_gemma3_llama_cpp_would_compute_otherwise_is_refused(tiny_model_factory, tmp_path):
    from slideformer.engine.errors import UserError
    folder = tiny_model_factory("gemma3_text", TinyShape(), seed=2)  # sliding and global alternate
    with pytest.raises(UserError, match="every sixth layer global"):
        export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert not list(tmp_path.iterdir())


def test_llama_cpp_applies_our_lora_gguf_as_the_merged_model(tiny_model_factory, tmp_path):
    base = tiny_model_factory("llama", TinyShape(), seed=2)
    lora = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=TARGETS, rslora=False)
    tensors = write_peft_adapter(tmp_path / "adapter", base, lora)
    adapter = export_lora_gguf(tmp_path / "adapter", tmp_path / "adapter.gguf", "f32", base)
    base_gguf = export_gguf(base, tmp_path / "base.gguf", "f32")
    merged = merged_folder(base, tmp_path / "merged", tensors, lora.alpha / lora.rank)
    ids = load_tokenizer(base).tok.encode(TEXT, add_special_tokens=True).ids
    llm = llama_cpp.Llama(model_path=str(base_gguf), lora_path=str(adapter), logits_all=True,
                          verbose=False, n_ctx=128, n_threads=2)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)])
    merged_gguf = llama_logits(export_gguf(merged, tmp_path / "merged.gguf", "f32"), ids)
    ref, plain = hf_logits(merged, ids), hf_logits(base, ids)
    # llama.cpp with the adapter = llama.cpp on the merged weights (6.5e-5 measured), and both
    # within llama.cpp's own distance of transformers on those weights (3.6e-3 of 0.82)
    assert np.abs(got - merged_gguf).max() <= 2e-4 * np.abs(ref).max()
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()
    assert np.abs(plain - ref).max() > 100 * np.abs(got - merged_gguf).max()  # it did something
