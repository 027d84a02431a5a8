"""Generation (slideformer.engine.generate) against Hugging Face transformers and the dense model.

Greedy replies must equal ``transformers``' ``generate(do_sample=False)`` token for token; the
cached forward must give the dense (uncached) model's logits; the sampler's filtering must equal
transformers' temperature + top-p logits processors.
"""
import shutil

import pytest
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.generate.cache import KVCache
from slideformer.engine.generate.decoder import Finished, forward
from slideformer.engine.generate.sampling import SamplingConfig, filter_logits, next_token
from slideformer.engine.generate.session import ChatModel, TextStream, end_of_turn_ids
from slideformer.engine.generate.source import resolve_model
from slideformer.engine.models.tiny import EOS, TinyShape

QUESTION = [{"role": "user", "content": "What is the sum of two and three?"}]
NEW = 24


def greedy(model: ChatModel, prompt, n=NEW):
    out = list(model.tokens(prompt, SamplingConfig(temperature=0, max_new_tokens=n)))
    return out[:-1], out[-1]


def hf_greedy(hf, prompt, stop_ids, n=NEW):
    from transformers import GenerationConfig
    ids = torch.tensor([prompt])
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=sorted(stop_ids),
                           pad_token_id=sorted(stop_ids)[0])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt):].tolist()


def assert_same_reply(ours, fin: Finished, theirs, stop_ids):
    """transformers keeps the stop token in its output; the engine reports it as the reason."""
    if fin.reason == "eos":
        assert theirs[:-1] == ours and theirs[-1] in stop_ids
    else:
        assert fin.reason == "length" and theirs == ours


def test_greedy_equals_transformers_generate_on_every_family(tiny_model, load_hf):
    model = ChatModel(tiny_model, mode="resident", device="cpu")
    prompt = model.prompt_ids(QUESTION)
    ours, fin = greedy(model, prompt)
    assert fin.prompt_tokens == len(prompt) and fin.new_tokens == len(ours)
    assert_same_reply(ours, fin, hf_greedy(load_hf(tiny_model), prompt, model.stop_ids),
                      model.stop_ids)


@pytest.mark.parametrize("extra", [
    {"tie_word_embeddings": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
], ids=["tied", "llama3-rope"])
def test_greedy_equals_transformers_on_llama_variants(tiny_model_factory, load_hf, extra):
    folder = tiny_model_factory("llama", TinyShape(tie=extra.get("tie_word_embeddings", False)),
                                extra_config=extra)
    model = ChatModel(folder, mode="resident", device="cpu")
    prompt = model.prompt_ids(QUESTION)
    ours, fin = greedy(model, prompt)
    assert_same_reply(ours, fin, hf_greedy(load_hf(folder), prompt, model.stop_ids),
                      model.stop_ids)


def test_streamed_window_gives_the_resident_tokens(tiny_model_factory):
    folder = tiny_model_factory("qwen2")
    resident = ChatModel(folder, mode="resident", device="cpu")
    prompt = resident.prompt_ids(QUESTION)
    expected = greedy(resident, prompt, 12)
    for slots, runs in ((2, 2), (3, 1)):  # a second reply reuses the window
        streamed = ChatModel(folder, mode="streamed", device="cpu", slots=slots)
        assert streamed.mode == "streamed" and streamed.weights.k == slots
        for _ in range(runs):
            assert greedy(streamed, prompt, 12)[0] == expected[0]
        streamed.close()


@pytest.mark.parametrize("arch,extra", [("mistral", None), ("mistral", {"sliding_window": 4}),
                                        ("gemma3_text", None), ("gpt_oss", {"sliding_window": 4}),
                                        ("qwen3_5_text", None),
                                        ("gemma4_text", {"sliding_window": 4}),
                                        ("gemma4_text", {"enable_moe_block": True})],
                         ids=["full", "window4", "gemma3", "gpt_oss-sinks-window4",
                              "qwen3_5-deltanet_state", "gemma4-head_sizes-window4",
                              "gemma4_moe"])
def test_cached_chunks_give_the_dense_models_logits(tiny_model_factory, load_dense, arch, extra):
    """Prompt in three chunks (the mask path for several new tokens over cached ones; with a
    window shorter than the chunks, the windowed cache mask too; a gated DeltaNet's state
    carried from chunk to chunk, one of them a single token; Gemma 4's caches of two head
    sizes and KV-head counts, its values from the keys' projection)."""
    folder = tiny_model_factory(arch, TinyShape(), extra)
    model = ChatModel(folder, mode="resident", device="cpu")
    prompt = model.prompt_ids(QUESTION)
    with torch.no_grad():
        full = load_dense(folder).logits(torch.tensor([prompt]))[0]  # (T, V)
    cache = KVCache(model.spec, len(prompt), torch.float32, "cpu")
    cuts = [0, 5, 6, len(prompt)]
    for a, b in zip(cuts, cuts[1:]):
        logits = forward(model.spec, model.weights, torch.tensor([prompt[a:b]]), cache)
        torch.testing.assert_close(logits, full[b - 1], rtol=1e-4, atol=1e-5)
    assert cache.length == len(prompt)


def test_a_training_checkpoint_chats_like_the_folder_it_was_saved_from(tiny_model_factory,
                                                                        tmp_path):
    from slideformer.engine import config as config_mod
    from slideformer.engine.config import ModelConfig, RunConfig
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.runtime.backend import CpuBackend
    from slideformer.engine.train.checkpoint import write_checkpoint
    from slideformer.engine.train.state import build_host_state, load_weights, state_tensors
    folder = tiny_model_factory("llama")
    spec = load_spec(folder)
    host = build_host_state(spec, CpuBackend(), torch.bfloat16, torch.float32)
    load_weights(host, spec, folder)  # bf16 weights + remainders: the exact fp32 masters
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(config_mod.dumps(RunConfig(model=ModelConfig(str(folder)))))
    step = write_checkpoint(run / "checkpoints", 3, state_tensors(host), {"step": 3}, keep=1)
    source = resolve_model(step)
    assert source.checkpoint and source.tokenizer_dir == folder
    plain, ckpt = ChatModel(folder, device="cpu"), ChatModel(step, device="cpu")
    for item in ("embed", "head"):
        assert torch.equal(getattr(plain.weights, f"{item}_w"), getattr(ckpt.weights, f"{item}_w"))
    prompt = plain.prompt_ids(QUESTION)
    assert greedy(ckpt, prompt)[0] == greedy(plain, prompt)[0]


def test_filtering_equals_transformers_temperature_and_top_p():
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopPLogitsWarper)
    g = torch.Generator().manual_seed(0)
    for temperature, top_p in ((0.7, 0.9), (1.3, 0.5), (1.0, 0.999), (0.5, 0.05)):
        logits = 3 * torch.randn(1, 500, generator=g)
        theirs = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits))
        ours = filter_logits(logits[0], temperature, top_p)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs[0]))
        keep = ~torch.isinf(ours)
        torch.testing.assert_close(ours[keep], theirs[0][keep])


def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    draws = lambda seed: [next_token(logits, SamplingConfig(temperature=1.0, top_p=1.0, seed=seed),  # noqa: E731
                                     g) for g in [torch.Generator().manual_seed(seed)] for _ in range(20)]
    assert draws(5) == draws(5)
    assert draws(5) != draws(6)
    g = torch.Generator().manual_seed(0)
    assert next_token(logits, SamplingConfig(temperature=1.0, top_p=1e-6), g) == int(logits.argmax())


def test_draws_follow_the_filtered_distribution_row_by_row():
    """The exponential race against the filtered probabilities: 40,000 draws (200 rows of a
    batch, 200 steps, each row its own generator) pass a chi-square test at p = 0.001, never pick
    a token outside the nucleus, and a row draws the same tokens alone as in the batch."""
    from slideformer.engine.generate.sampling import generator, next_tokens
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, -4.0])
    cfg = SamplingConfig(temperature=0.8, top_p=0.97)
    probs = filter_logits(logits, cfg.temperature, cfg.top_p).softmax(-1)
    assert (probs == 0).sum() == 3  # the three least likely tokens are outside the nucleus
    rows = 200
    gens = [generator(seed, "cpu") for seed in range(rows)]
    counts = torch.zeros(len(logits))
    first_row = []
    for _ in range(200):
        toks = next_tokens(logits.expand(rows, -1), [cfg] * rows, gens)
        counts += torch.bincount(torch.tensor(toks), minlength=len(logits))
        first_row.append(toks[0])
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * counts.sum()
    chi2 = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, chi2  # 3 degrees of freedom, p = 0.001
    alone = generator(0, "cpu")
    assert [next_token(logits, cfg, alone) for _ in range(200)] == first_row


def test_a_sampled_reply_repeats_with_its_seed(tiny_model_factory):
    model = ChatModel(tiny_model_factory("llama"), device="cpu")
    prompt = model.prompt_ids(QUESTION)
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=3)
    first = list(model.tokens(prompt, cfg))[:-1]
    assert list(model.tokens(prompt, cfg))[:-1] == first


def test_stop_flag_ends_the_reply_and_says_so(tiny_model_factory):
    model = ChatModel(tiny_model_factory("llama"), device="cpu")
    seen = []
    out = list(model.tokens(model.prompt_ids(QUESTION),
                            SamplingConfig(temperature=1.0, max_new_tokens=50),
                            should_stop=lambda: len(seen) >= 3 or seen.append(1)))
    assert out[-1].reason == "stopped" and out[-1].new_tokens == 3 and len(out) == 4


def test_stop_tokens_include_the_templates_end_of_turn(tiny_model_factory):
    model = ChatModel(tiny_model_factory("llama"), device="cpu")
    im_end = model.tok.tok.token_to_id(EOS)
    assert end_of_turn_ids(model.tok) == {im_end}
    assert im_end in model.stop_ids


def test_text_stream_holds_back_a_split_character(tiny_model_factory):
    model = ChatModel(tiny_model_factory("llama"), device="cpu")
    text = "naïve café 😀 done"
    ids = model.tok.encode(text)
    stream = TextStream(model.tok)
    pieces = [stream.feed(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_reply_streams_text_then_finishes(tiny_model_factory):
    model = ChatModel(tiny_model_factory("llama"), device="cpu")
    out = list(model.reply(QUESTION, SamplingConfig(temperature=0, max_new_tokens=10)))
    ids, fin = greedy(model, model.prompt_ids(QUESTION), 10)
    assert isinstance(out[-1], Finished)
    assert "".join(p.text for p in out[:-1]) == model.tok.decode(ids)


def test_not_a_model_folder_is_one_clear_error(tmp_path, tiny_model_factory):
    with pytest.raises(UserError, match="neither a model folder"):
        resolve_model(tmp_path)
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_factory("llama"), broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(UserError, match="safetensors"):
        ChatModel(broken, device="cpu")
    with pytest.raises(UserError, match="--mode"):
        ChatModel(broken, mode="fast")


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_a_lora_adapter_folder_chats_like_its_merged_model(tiny_model_factory, tmp_path, arch):
    """An adapter folder (a LoRA run's final/) is its base with s * B @ A added: the layers equal
    those of the merged folder (W + s * B @ A in fp32, written out) and so does the reply
    (Qwen3.5: the gated DeltaNet layers have no q_proj or v_proj, only the MLP's adapter)."""
    import json

    from safetensors.torch import load_file, save_file

    from slideformer.engine.models.lora import PROJECTIONS, LoraSpec, layer_targets
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.weights import hf_name
    from slideformer.engine.train.lora_export import PEFT_PREFIX, adapter_config
    base = tiny_model_factory(arch)
    spec, g = load_spec(base), torch.Generator().manual_seed(0)
    lora = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("q_proj", "v_proj", "down_proj"))
    tensors = {}
    for i in range(spec.num_layers):
        for t in layer_targets(spec, lora, i):
            out, inp = spec.layout(i).shape(PROJECTIONS[t] + ".weight")
            name = PEFT_PREFIX + hf_name(f"layer{i}", PROJECTIONS[t])
            tensors[f"{name}.lora_A.weight"] = torch.randn(lora.rank, inp, generator=g)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, lora.rank, generator=g)
    adapter = tmp_path / "run" / "final"
    adapter.mkdir(parents=True)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps(adapter_config(lora, str(base))))
    merged = tmp_path / "merged"
    shutil.copytree(base, merged)
    weights = {k: v.float() for k, v in load_file(str(base / "model.safetensors")).items()}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            b = tensors[key.replace("lora_A", "lora_B")]
            weights[key.removeprefix(PEFT_PREFIX).replace(".lora_A", "")] += lora.scaling * (b @ a)
    save_file(weights, str(merged / "model.safetensors"), metadata={"format": "pt"})

    plain = ChatModel(base, device="cpu", mode="resident")
    adapted = ChatModel(adapter, device="cpu", mode="resident")
    reference = ChatModel(merged, device="cpu", mode="resident")
    assert resolve_model(adapter).tokenizer_dir == base  # no tokenizer copied into this one
    for ours, theirs, before in zip(adapted.weights.layer_w, reference.weights.layer_w,
                                    plain.weights.layer_w):
        assert torch.equal(ours, theirs) and not torch.equal(ours, before)
    prompt = plain.prompt_ids(QUESTION)
    assert greedy(adapted, prompt)[0] == greedy(reference, prompt)[0]
