"""GRPO on the sliding engine: the step equals the paper's loss on a dense reference, a tiny model
learns a checkable reward, a resumed run is the uninterrupted one, bad inputs are refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.config import DataConfig, GrpoConfig, OptimConfig
from slideformer.engine.errors import UserError
from slideformer.engine.events import RolloutMetrics, read_events
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.engine.models.weights import item_layout, item_names, stored_views
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.grpo import GrpoStream, advantages, read_prompts
from slideformer.engine.train.schedule import lr_at
from slideformer.engine.train.state import build_host_state, load_weights
from tests.engine.runtime.test_family_training import _weights, reference_adamw

transformers = pytest.importorskip("transformers")

OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, schedule="cosine", warmup_steps=1,
                    max_grad_norm=0.5)
STEPS, G, MICRO, ACCUM, T = 3, 4, 4, 2, 32
SEVENS = '''def reward(prompt, completion, record):
    """The share of the reply's characters that are the record's answer (a digit)."""
    return completion.count(record["answer"]) / max(len(completion), 1)
'''


def prompts_file(path: Path, n: int = 16) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Write sevens, line {i}:", "answer": "7"})
                            + "\n" for i in range(n)))
    return path


def fixed_steps(folder: Path, tmp_path: Path) -> list:
    """Three GRPO steps of replies drawn here (random ids, some ended by the eos token), their
    rewards from SEVENS: what the engine and the reference both train on."""
    tok = load_tokenizer(folder)
    data = DataConfig(train=str(prompts_file(tmp_path / "p.jsonl")), max_seq_len=T)
    prompts = read_prompts(data, tok, ChatRenderer(tok))
    (tmp_path / "r.py").write_text(SEVENS)
    stream = GrpoStream(prompts, GrpoConfig(group_size=G, reward=str(tmp_path / "r.py")), MICRO,
                        ACCUM, 0, T, tok.pad_id or 0, tok)
    stream.policy = FixedReplies(tok)
    return [stream.next_step() for _ in range(STEPS)]


class FixedReplies:
    """A stand-in for grpo.Sampler: seeded random replies, some with "7"s, some stopped."""

    def __init__(self, tok):
        self.tok, self.rng, self.digits = tok, np.random.default_rng(5), tok.encode("7")

    def start(self) -> None:
        pass

    def done(self) -> None:
        pass

    def groups(self, prompts, seeds):
        return [[self.reply() for _ in ss] for ss in seeds]

    def reply(self):
        rng = self.rng
        ids = [int(i) for i in rng.integers(10, 300, int(rng.integers(1, 9)))]
        if rng.random() < 0.5:
            ids = ids + self.digits * int(rng.integers(1, 4))
        return (ids + [self.tok.eos_id], True) if rng.random() < 0.5 else (ids, False)


def dense_train(model, steps) -> list[float]:
    params, opt = reference_adamw(model, OPTIM)
    losses = []
    for k, mbs in enumerate(steps, start=1):
        opt.zero_grad()
        loss = 0.0
        for mb in mbs:  # the paper's loss: -sum_i A_i / (P G |o_i|) sum_t log pi(o_i,t)
            z = model(input_ids=mb.input_ids).logits.float()
            ce = torch.nn.functional.cross_entropy(z.transpose(1, 2), mb.labels,
                                                   ignore_index=-100, reduction="none")
            part = (ce.sum(1) * mb.weights).sum()
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(params, OPTIM.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(k, STEPS, OPTIM)
        opt.step()
        losses.append(loss)
    return losses


def engine_steps(spec, host, steps, grpo: GrpoConfig, lora=None) -> list[float]:
    """The losses of ``steps`` trained by the sliding executor on ``host`` (OPTIM, 2 slots)."""
    ex = SlidingExecutor(spec, CpuBackend(), host, ExecShape(micro_batch=MICRO, seq_len=T,
                                                             n_micro=ACCUM, slots=2),
                         torch.float32, lora=lora)
    ex.objective = ("grpo", grpo)
    losses = []
    for k, mbs in enumerate(steps, start=1):
        hyper = lambda coef, k=k: AdamHyper(lr_at(k, STEPS, OPTIM), OPTIM.beta1, OPTIM.beta2,  # noqa: E731
                                            OPTIM.eps, OPTIM.weight_decay, k, coef)
        losses.append(ex.train_step(mbs, hyper, OPTIM.max_grad_norm).loss)
    ex.close()
    return losses


def test_a_grpo_step_is_the_papers_loss(tiny_model_factory, load_hf, tmp_path):
    folder = tiny_model_factory("llama", TinyShape(), seed=1)
    spec = load_spec(folder)
    steps = fixed_steps(folder, tmp_path)
    # the weights: A / (P G |o|), a group's advantages normalised
    w = torch.cat([mb.weights for mb in steps[0]])
    lengths = torch.tensor([float((mb.labels[r] != -100).sum()) for mb in steps[0]
                            for r in range(len(mb.labels))])
    adv = (w * lengths * (MICRO * ACCUM)).view(-1, G)
    assert torch.allclose(adv.sum(1), torch.zeros(len(adv)), atol=1e-4)
    assert adv.abs().max() > 0.1
    ref = load_hf(folder)
    ref_losses = dense_train(ref, steps)
    host = build_host_state(spec, CpuBackend(), torch.float32, torch.float32, layer_grads=True)
    load_weights(host, spec, folder)
    losses = engine_steps(spec, host, steps, GrpoConfig())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4,
                               atol=1e-6)
    final = _weights(spec, ref)
    for item in item_names(spec):
        for name, ours in stored_views(spec, item, item_layout(spec, item).views(host[item].master())):
            rel = ((ours - final[name]).norm() / final[name].norm()).item()
            assert rel < 1e-4, f"{name}: relative difference {rel:.2e}"


def test_a_lora_grpo_step_with_the_kl_penalty_is_the_papers_loss(tiny_model_factory, tmp_path):
    """KL to the base (adapters off) at beta 0.5 against PEFT trained on the paper's loss with
    DeepSeekMath's estimator exp(r - l) - (r - l) - 1 per reply token, weighted 1 / (P G |o|)."""
    from slideformer.engine.config import LoraConfig
    from slideformer.engine.models.lora import for_model, lora_spec
    from tests.engine.runtime.test_lora_equivalence import assert_same, lora_host, peft_model
    folder = tiny_model_factory("llama", TinyShape(layers=3), seed=1)
    spec, beta = load_spec(folder), 0.5
    steps = fixed_steps(folder, tmp_path)
    lora = for_model(lora_spec(LoraConfig(rank=4, alpha=8.0)), spec)
    host = lora_host(spec, folder, lora)
    model = peft_model(folder, lora, host, spec)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2),
                            eps=OPTIM.eps, weight_decay=OPTIM.weight_decay)
    ref_losses, kls = [], []
    for k, mbs in enumerate(steps, start=1):
        opt.zero_grad()
        total = 0.0
        for mb in mbs:
            def token_logps():
                z = model(input_ids=mb.input_ids).logits.float()
                return -torch.nn.functional.cross_entropy(z.transpose(1, 2), mb.labels,
                                                          ignore_index=-100, reduction="none")
            with torch.no_grad(), model.disable_adapter():
                r = token_logps()
            lp, on = token_logps(), mb.labels != -100
            d = torch.where(on, r - lp, 0.0)
            kl = (mb.norm[:, None] * torch.where(on, d.exp() - d - 1, 0.0)).sum()
            part = (-lp.sum(1) * mb.weights).sum() + beta * kl
            part.backward()
            total += part.item()
            kls.append(kl.item())
        torch.nn.utils.clip_grad_norm_(trained, OPTIM.max_grad_norm)
        for g in opt.param_groups:
            g["lr"] = lr_at(k, STEPS, OPTIM)
        opt.step()
        ref_losses.append(total)
    assert max(kls) > 1e-4  # the adapters move the policy away from the base: the term acts
    losses = engine_steps(spec, host, steps, GrpoConfig(kl_beta=beta), lora)
    # the loss is a mean of advantage-weighted ratios that nearly cancel (-0.018 here, from terms
    # of order one): its fp32 rounding is absolute, ~1e-7 (1.8e-7 under transformers 5.25)
    assert_same(spec, lora, host, model, losses, ref_losses, atol=1e-6)


def test_advantages_are_normalised_within_each_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = advantages(r)
    assert torch.allclose(a[0], (r[0] - 0.5) / (r[0].std() + 1e-4))
    assert torch.equal(a[1], torch.zeros(4))  # one reward for all: no signal


def grpo_run(tiny_run, run_dir: Path, tmp_path: Path, steps: int, **over):
    (tmp_path / "sevens.py").write_text(SEVENS)
    cfg = tiny_run(run_dir, {"train.objective": "grpo", "train.max_steps": steps,
                             "train.micro_batch": 16, "optim.lr": 1e-2, "optim.warmup_steps": 0,
                             "data.max_seq_len": 32, "grpo.group_size": 8,
                             "grpo.max_new_tokens": 8, "grpo.reward": str(tmp_path / "sevens.py"),
                             **over}, shape=TinyShape())
    cfg = config_mod.override(cfg, {"data.train": str(prompts_file(tmp_path / "sevens.jsonl",
                                                                   64))})
    return cfg


def rewards(run_dir: Path) -> list[float]:
    return [e.reward_mean for e in read_events(run_dir / "events.jsonl")
            if isinstance(e, RolloutMetrics)]


def test_a_tiny_model_learns_the_reward(tiny_run, tmp_path):
    """A random tiny model almost never writes "7"; 40 GRPO steps (16 replies of 8 tokens,
    groups of 8) make it (measured here: 0.01 in the first steps, 0.4 to 0.5 at the end)."""
    cfg = grpo_run(tiny_run, tmp_path / "run", tmp_path, 40)
    assert run_training(cfg) == "finished"
    got = rewards(tmp_path / "run")
    assert len(got) == 40
    assert np.mean(got[:5]) < 0.05 and np.mean(got[-5:]) > 0.2, got


def test_a_resumed_grpo_run_is_the_uninterrupted_one(tiny_run, tmp_path):
    """2 steps, then 2 more by --resume: the same replies and the same final weights as 4 steps
    at once (a constant learning rate: the step count does not shape the schedule)."""
    flat = {"optim.schedule": "constant"}
    whole = grpo_run(tiny_run, tmp_path / "whole", tmp_path, 4, **flat)
    assert run_training(whole) == "finished"
    part = grpo_run(tiny_run, tmp_path / "part", tmp_path, 2, **flat)
    assert run_training(part) == "finished"
    more = config_mod.override(part, {"train.max_steps": 4})
    assert run_training(more, resume=True) == "finished"
    assert rewards(tmp_path / "part") == rewards(tmp_path / "whole")
    from safetensors.torch import load_file
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(tmp_path / "part" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("record, says", [
    ({"answer": "7"}, "has no prompt"),
    ({"prompt": "x", "answer": 7}, "not text"),
    ({"messages": [{"role": "user", "content": "x"}]}, "do not end with the assistant"),
    ({"prompt": "x " * 40, "answer": "7"}, "no room"),
    ({"prompt": [{"role": "user"}], "answer": "7"}, "has no prompt"),
])
def test_bad_prompt_records_are_refused_naming_the_record(tiny_model_factory, tmp_path, record,
                                                          says):
    tok = load_tokenizer(tiny_model_factory("llama"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as e:
        read_prompts(DataConfig(train=str(path), max_seq_len=32), tok, ChatRenderer(tok))
    assert str(e.value).startswith(f"{path}:2") and says in str(e.value)


@pytest.mark.parametrize("body, says", [
    ("x = 1\n", "defines no reward function"),
    ("def reward(p, c, r):\n    return float('nan')\n", "returned nan"),
    ("def reward(p, c, r):\n    return r['missing']\n", "raised KeyError"),
    ("import nonexistent_module_xyz\n", "failed to load"),
])
def test_a_broken_reward_file_is_named(tiny_run, tmp_path, body, says):
    cfg = grpo_run(tiny_run, tmp_path / "run", tmp_path, 1)
    (tmp_path / "sevens.py").write_text(body)
    with pytest.raises(UserError) as e:
        run_training(cfg)
    assert str(e.value).startswith(str(tmp_path / "sevens.py")) and says in str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("over, key", [({"grpo.group_size": 1}, "grpo.group_size"),
                                       ({"grpo.group_size": 5}, "train.micro_batch"),
                                       ({"grpo.kl_beta": 0.1}, "grpo.kl_beta"),  # full FT
                                       ({"grpo.answer_regex": "(("}, "grpo.answer_regex"),
                                       ({"grpo.temperature": 0.0}, "grpo.temperature")])
def test_grpo_settings_that_cannot_work_are_refused(tiny_run, tmp_path, over, key):
    from slideformer.engine.validate import validate
    with pytest.raises(UserError) as e:
        validate(config_mod.override(grpo_run(tiny_run, tmp_path / "r", tmp_path, 1), over))
    assert str(e.value).startswith(key)


def test_the_plan_counts_what_sampling_holds(tiny_model_factory, tiny_run, tmp_path):
    """The planner's rollout rows are the bytes ResidentWeights and a group's KVCache
    allocate, and a GRPO plan holds them (peak = state + run + rollout when sampling is the
    larger part)."""
    from slideformer.engine.generate.cache import KVCache
    from slideformer.engine.generate.window import ResidentWeights
    from slideformer.engine.plan import plan_run
    from slideformer.engine.plan.memory import Precision, rollout_allocations
    from slideformer.engine.train.grpo import PolicyReader
    spec = load_spec(tiny_model_factory("llama", TinyShape()))
    rows = {a.purpose: a.bytes for a in rollout_allocations(
        spec, Precision(torch.float32, torch.float32), T, G)}
    host = build_host_state(spec, CpuBackend(), torch.float32, torch.float32)
    w = ResidentWeights(spec, PolicyReader(host, None), torch.float32, CpuBackend())
    held = sum(t.numel() * t.element_size() for t in (w.embed_w, *w.layer_w, w.head_w))
    assert rows["sampling: the weights resident"] == held
    assert rows["sampling: the replies' KV cache"] == KVCache(spec, T, torch.float32, "cpu",
                                                           batch=G).nbytes()
    cfg = grpo_run(tiny_run, tmp_path / "r", tmp_path, 1)
    plan = plan_run(cfg, load_spec(cfg.model.path), device="cpu")
    sampling = [a for a in plan.allocations if a.phase == "rollout"]
    assert {a.purpose for a in sampling} == set(rows)
    # grpo.prompts_together prompts' groups at once, each row up to its slots in a shared cache
    from slideformer.engine.plan.planner import rollout_rows, rollout_tokens
    P = cfg.train.micro_batch * cfg.train.grad_accum // cfg.grpo.group_size
    R = cfg.grpo.group_size * min(cfg.grpo.prompts_together, P)
    assert rollout_rows(cfg) == R
    kv = next(a.bytes for a in sampling if a.purpose == "sampling: the replies' KV cache")
    assert kv == KVCache(load_spec(cfg.model.path), rollout_tokens(cfg), torch.float32, "cpu",
                         batch=R).nbytes()
    held = sum(a.bytes for a in plan.allocations if a.phase in ("state", "run", "rollout")
               and a.tier in ("gpu", "host"))  # the CPU backend's RAM
    assert plan.tier("host").peak >= held
    sft = plan_run(config_mod.override(cfg, {"train.objective": "sft"}),
                   load_spec(cfg.model.path), device="cpu")
    assert not any(a.phase == "rollout" for a in sft.allocations)
    lora = plan_run(config_mod.override(cfg, {"train.method": "lora"}),
                    load_spec(cfg.model.path), device="cpu")  # samples through its window
    assert [a.purpose for a in lora.allocations if a.phase == "rollout"] == \
        ["sampling: the replies' KV cache"]


def test_the_plan_decodes_as_many_prompts_together_as_fit(tiny_run, tmp_path):
    """grpo.prompts_together is an upper bound: the plan takes the most prompts whose groups'
    KV caches fit (ExecShape.rollout_prompts, which the run decodes at once). A 3B full
    fine-tune's GRPO at 2K tokens, replies of up to 512, 4 prompts a step: all 4 together
    under 80 GiB, fewer under 24 GiB (4 prompts' 32 rows of 2.5K positions are 8.75 GiB of KV
    cache beside the resident model), and the sampling time counts the batches."""
    import shutil
    from slideformer.engine.plan import REFERENCE, plan_run
    cfg = grpo_run(tiny_run, tmp_path / "r", tmp_path, 1)
    d = tmp_path / "3b"
    d.mkdir()
    shutil.copy(Path(__file__).parents[2] / "fixtures" / "configs" / "llama-3.2-3b.json",
                d / "config.json")
    cfg = config_mod.override(cfg, {"model.path": str(d), "data.max_seq_len": 2048,
                                    "grpo.max_new_tokens": 512, "train.micro_batch": 8,
                                    "train.grad_accum": 4, "budget.ram": "100GiB",
                                    "train.device": "cuda"})  # planned for a GPU, run on none
    spec = load_spec(d)
    big, small = (plan_run(config_mod.override(cfg, {"budget.vram": v}), spec, hardware=REFERENCE)
                  for v in ("80GiB", "24GiB"))
    n = small.exec_shape.rollout_prompts
    assert big.exec_shape.rollout_prompts == 4 and 1 <= n < 4
    assert small.verdict != "does not fit" and small.tier("gpu").phase == "rollout"
    kv = [a.bytes for p in (big, small) for a in p.allocations if "KV cache" in a.purpose]
    assert kv[0] * n == kv[1] * 4 * (1 if n > 1 else (2048 + 512) / 2048)
    one_more = plan_run(config_mod.override(cfg, {"budget.vram": "24GiB",
                                                  "grpo.prompts_together": n + 1}),
                        spec, hardware=REFERENCE)  # the most that fit: n + 1 would not
    assert one_more.exec_shape.rollout_prompts == n
    # the sampling time: 4 prompts' decode steps at once, or 4 times one after another
    from slideformer.engine.plan.report import format_plan
    from slideformer.engine.plan.speed import rollout_time
    rate = REFERENCE.matmul_tflops * 1e12
    assert small.speed.rollout_s == rollout_time(spec, "full", 4, n, 512, 1536, rate)
    assert big.speed.rollout_s == rollout_time(spec, "full", 4, 4, 512, 1536, rate)
    assert small.speed.rollout_s > 1.5 * big.speed.rollout_s  # 2 or 4 batches against one
    assert "GRPO sampling before each step: up to" in format_plan(small)


def test_data_inspect_prompts_shows_what_the_model_is_asked(tiny_run, tmp_path, capsys):
    from slideformer.engine.cli import main
    model = tiny_run(tmp_path / "unused").model.path
    f = prompts_file(tmp_path / "p.jsonl", n=5)
    assert main(["data", "inspect", str(f), "--model", model, "--prompts", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "prompts     5 (5 with an answer" in out and "Write sevens, line 1:" in out
    assert "answer '7'" in out
    # read as SFT data, the same file is refused with the way to train on it
    assert main(["data", "inspect", str(f), "--model", model]) == 2
    err = capsys.readouterr().err
    assert "GRPO's prompts" in err and "--objective grpo" in err and "--prompts" in err



@pytest.mark.parametrize("arch,extra", [
    ("llama", None), ("mistral", {"sliding_window": 4}), ("qwen3_5_text", None),
    ("gpt_oss", None)])
def test_a_group_decoded_together_gives_each_reply_sampled_alone(arch, extra, tiny_model_factory):
    """sample_group (G rows per forward) against sample_reply (one row), seed by seed, on
    families whose generation carries different state: KV, a sliding window over a prompt
    longer than it, a gated DeltaNet's recurrence, attention sinks. Replies end at different
    lengths (stop tokens and the token limit both occur)."""
    from slideformer.engine.generate.sampling import SamplingConfig
    from slideformer.engine.generate.window import ResidentWeights
    from slideformer.engine.models.weights import Checkpoint
    from slideformer.engine.train.grpo import sample_group, sample_reply
    folder = tiny_model_factory(arch, TinyShape(), extra)
    spec = load_spec(folder)
    weights = ResidentWeights(spec, Checkpoint(folder), torch.float32, CpuBackend())
    prompt = [3, 17, 42, 9, 11, 5, 77]
    cfgs = [SamplingConfig(temperature=1.5, top_p=0.95, max_new_tokens=12, seed=s)
            for s in range(8)]
    stops = frozenset(range(0, spec.vocab_size, 9))  # every ninth id ends a reply
    together = sample_group(spec, weights, prompt, cfgs, stops, "cpu", torch.float32)
    alone = [sample_reply(spec, weights, prompt, c, stops, "cpu", torch.float32) for c in cfgs]
    assert together == alone
    assert {len(r) for r, _ in alone} != {12} and any(s for _, s in alone)


@pytest.mark.parametrize("arch,extra", [
    ("llama", None), ("mistral", {"sliding_window": 4}), ("qwen3_5_text", None),
    ("gpt_oss", None), ("gemma3_text", None)])
def test_prompts_of_different_lengths_decoded_together_give_each_reply_sampled_alone(
        arch, extra, tiny_model_factory):
    """sample_groups (three prompts of 2, 9 and 5 tokens, their groups in one batch: each row
    at its own positions, its keys masked past its prompt) against sample_reply, seed by seed:
    KV caches with gaps, sliding windows counted by position, a DeltaNet's per-row state,
    attention sinks."""
    from slideformer.engine.generate.sampling import SamplingConfig
    from slideformer.engine.generate.window import ResidentWeights
    from slideformer.engine.models.weights import Checkpoint
    from slideformer.engine.train.grpo import sample_groups, sample_reply
    folder = tiny_model_factory(arch, TinyShape(), extra)
    spec = load_spec(folder)
    weights = ResidentWeights(spec, Checkpoint(folder), torch.float32, CpuBackend())
    prompts = [[3, 17], [42, 9, 11, 5, 77, 8, 30, 2, 6], [12, 4, 19, 23, 7]]
    cfgs = [[SamplingConfig(temperature=1.5, top_p=0.95, max_new_tokens=n, seed=10 * q + s)
             for s in range(3)] for q, n in enumerate((12, 7, 10))]
    stops = frozenset(range(0, spec.vocab_size, 9))  # every ninth id ends a reply
    together = sample_groups(spec, weights, prompts, cfgs, stops, "cpu", torch.float32)
    alone = [[sample_reply(spec, weights, p, c, stops, "cpu", torch.float32) for c in cs]
             for p, cs in zip(prompts, cfgs)]
    assert together == alone
    flat = [r for group in alone for r in group]
    assert any(s for _, s in flat) and any(not s for _, s in flat)


@pytest.mark.parametrize("nf4", [False, True], ids=["lora", "qlora"])
def test_a_lora_run_samples_through_its_window_as_from_the_merged_model(nf4, tiny_model_factory,
                                                                       tmp_path):
    """GRPO's sampling of a LoRA / QLoRA run goes through the training window (base in 2 of 3
    slots, NF4 dequantised on the device, adapters unmerged) after a step moved the adapters:
    its logits equal the merged model's (ResidentWeights over PolicyReader) and its replies
    are the same tokens."""
    from slideformer.engine.config import LoraConfig
    from slideformer.engine.generate.cache import KVCache
    from slideformer.engine.generate.decoder import forward_rows
    from slideformer.engine.generate.sampling import SamplingConfig
    from slideformer.engine.generate.window import ResidentWeights
    from slideformer.engine.models.lora import for_model, lora_spec
    from slideformer.engine.train.grpo import PolicyReader, WindowWeights, sample_group
    from tests.engine.runtime.test_lora_equivalence import lora_host
    folder = tiny_model_factory("llama", TinyShape(layers=3), seed=1)
    spec = load_spec(folder)
    lora = for_model(lora_spec(LoraConfig(rank=4, alpha=8.0)), spec)
    host = lora_host(spec, folder, lora, nf4=nf4)
    ex = SlidingExecutor(spec, CpuBackend(), host, ExecShape(micro_batch=MICRO, seq_len=T,
                                                             n_micro=ACCUM, slots=2),
                         torch.float32, lora=lora)
    ex.objective = ("grpo", GrpoConfig())
    hyper = lambda coef: AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, 1, coef)  # noqa: E731
    ex.train_step(fixed_steps(folder, tmp_path)[0], hyper, 1.0)
    ex.drain()
    window = WindowWeights(ex)
    merged = ResidentWeights(spec, PolicyReader(host, lora), torch.float32, CpuBackend())
    prompt = [3, 17, 42, 9, 11]
    ids = torch.tensor([prompt, prompt[::-1]])
    a, b = (forward_rows(spec, w, ids, KVCache(spec, 8, torch.float32, "cpu", batch=2))
            for w in (window, merged))
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    cfgs = [SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=10, seed=s)
            for s in range(4)]
    assert sample_group(spec, window, prompt, cfgs, frozenset(), "cpu", torch.float32) == \
        sample_group(spec, merged, prompt, cfgs, frozenset(), "cpu", torch.float32)
    ex.close()
