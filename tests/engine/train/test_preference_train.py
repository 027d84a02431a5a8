"""Preference runs end to end on the CPU: a model learns a stated preference, the first DPO step
has loss log 2, resume is exact, the data conventions hold and bad records are refused.

The task: the prompt is a lowercase word; the chosen reply is the word in capitals, the rejected
one another lowercase word. Learning to prefer capitals generalises to words never seen.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.config import DataConfig
from slideformer.engine.data.conversation import Conversation
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.encode import encode_chats
from slideformer.engine.data.preference import read_pairs
from slideformer.engine.errors import UserError
from slideformer.engine.events import PairMetrics, RunState, StepMetrics, read_events
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.engine.train.commands import run_training

transformers = pytest.importorskip("transformers")
LETTERS = "abcdefghijklmnop"


def word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))


def write_pairs(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            w = word(rng)
            other = word(rng)
            f.write(json.dumps({"prompt": f"{w} =", "chosen": f" {w.upper()}",
                                "rejected": f" {other}"}) + "\n")
    return path


def write_kto(path: Path, n: int, seed: int) -> Path:
    """Half the records a word in capitals (desirable), half another lowercase word (not)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            w = word(rng)
            good = i % 2 == 0
            f.write(json.dumps({"prompt": f"{w} =", "completion": f" {w.upper() if good else word(rng)}",
                                "label": good}) + "\n")
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    write_pairs(root / "pairs.jsonl", 160, 1)
    write_pairs(root / "held-out.jsonl", 60, 2)
    write_kto(root / "kto.jsonl", 160, 3)
    return root


@pytest.fixture(scope="module")
def make(tiny_run, root):
    def make(name: str, **over) -> config_mod.RunConfig:
        return tiny_run(root / "runs" / name, {
            "data.train": str(root / "pairs.jsonl"), "data.max_seq_len": 32,
            "train.objective": "dpo", "preference.beta": 0.1, "optim.lr": 5e-3,
            "optim.weight_decay": 0.0, "train.micro_batch": 4, "train.grad_accum": 2,
            "train.max_steps": 40, **{k.replace("__", "."): v for k, v in over.items()}})
    return make


def events(cfg, kind) -> list:
    return [e for e in read_events(Path(cfg.output.run_dir) / "events.jsonl")
            if isinstance(e, kind)]


def logps(model, seqs) -> np.ndarray:
    """Summed log-probabilities of each sequence's response tokens, by transformers."""
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.from_numpy(s.ids.astype(np.int64))[None]
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            tok = lp.gather(-1, ids[0, 1:, None])[:, 0]
            out.append(float((tok * torch.from_numpy(s.mask[1:]).float()).sum()))
    return np.asarray(out)


@pytest.fixture(scope="module")
def dpo(make):
    cfg = make("dpo")
    assert run_training(cfg) == "finished"
    return cfg


def test_dpo_learns_the_preference_on_held_out_pairs(dpo, root):
    losses = [e.loss for e in events(dpo, StepMetrics)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference at step 1
    pairs = events(dpo, PairMetrics)
    assert [p.step for p in pairs] == list(range(1, 41))
    tok = load_tokenizer(dpo.model.path)
    held = read_pairs(DataConfig(train=str(root / "held-out.jsonl"), max_seq_len=32), tok).pairs
    before = transformers.AutoModelForCausalLM.from_pretrained(dpo.model.path, dtype=torch.float32)
    after = transformers.AutoModelForCausalLM.from_pretrained(
        Path(dpo.output.run_dir) / "final", dtype=torch.float32)
    chosen = [p.chosen for p in held]
    rejected = [p.rejected for p in held]
    margin = (logps(after, chosen) - logps(before, chosen)) - \
        (logps(after, rejected) - logps(before, rejected))
    assert (margin > 0).mean() >= 0.9, f"positive margins: {(margin > 0).mean():.0%}"
    assert pairs[-1].accuracy >= 0.9 and pairs[-1].margin > 0


def test_kto_learns_which_replies_are_desirable(make, root):
    cfg = make("kto", train__objective="kto", data__train=str(root / "kto.jsonl"))
    assert run_training(cfg) == "finished"
    assert [e.loss for e in events(cfg, StepMetrics)][0] == pytest.approx(0.5, abs=1e-6)
    tok = load_tokenizer(cfg.model.path)
    held = read_pairs(DataConfig(train=str(root / "held-out.jsonl"), max_seq_len=32), tok).pairs
    before = transformers.AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    after = transformers.AutoModelForCausalLM.from_pretrained(
        Path(cfg.output.run_dir) / "final", dtype=torch.float32)
    good = [p.chosen for p in held]  # the held-out pairs' capitals: desirable, never seen
    bad = [p.rejected for p in held]
    assert (logps(after, good) - logps(before, good) > 0).mean() >= 0.9
    assert (logps(after, bad) - logps(before, bad) < 0).mean() >= 0.9
    last = events(cfg, PairMetrics)[-1]
    assert last.chosen_reward > 0 > last.rejected_reward


def test_a_resumed_dpo_run_equals_the_uninterrupted_one(make):
    from safetensors.torch import load_file
    # a constant rate: the 3-step first half then has the schedule of the 6-step run
    whole = make("dpo-6", train__max_steps=6, train__save_every=1, optim__schedule="constant")
    assert run_training(whole) == "finished"
    cut = make("dpo-3-then-6", train__max_steps=6, train__save_every=1, optim__schedule="constant")
    assert run_training(config_mod.override(cut, {"train.max_steps": 3})) == "finished"
    assert run_training(cut, resume=True) == "finished"
    a = load_file(str(Path(whole.output.run_dir) / "final" / "model.safetensors"))
    b = load_file(str(Path(cut.output.run_dir) / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [e.loss for e in events(whole, StepMetrics)][3:] == \
        [e.loss for e in events(cut, StepMetrics)][3:]
    assert "objective = \"dpo\"" in (Path(cut.output.run_dir) / "config.toml").read_text()


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_adapter_dpo_starts_from_the_base_as_its_reference(make, method):
    # the adapters start at zero: the reference pass (adapters on) is the base, adapters off
    cfg = make(f"dpo-{method}", train__method=method, train__max_steps=3, optim__lr=1e-3)
    assert run_training(cfg) == "finished"
    losses = [e.loss for e in events(cfg, StepMetrics)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and losses[-1] < losses[0]
    assert (Path(cfg.output.run_dir) / "final" / "adapter_config.json").is_file()


def test_simpo_and_orpo_runs_train(make):
    for kind, beta in (("simpo", 2.0), ("orpo", 0.1)):
        cfg = make(kind, train__objective=kind, preference__beta=beta, train__max_steps=4)
        assert run_training(cfg) == "finished"
        assert events(cfg, RunState)[-1].state == "finished"
        assert not (Path(cfg.output.run_dir) / "reference-logps.npy").exists()  # no reference


def test_a_plain_pair_is_bos_prompt_reply_eos(tiny_model):
    tok = load_tokenizer(tiny_model)
    path = tiny_model.parent / "one.jsonl"
    path.write_text(json.dumps({"prompt": "ab =", "chosen": " AB", "rejected": " cd"}) + "\n")
    (pair,) = read_pairs(DataConfig(train=str(path), max_seq_len=32), tok).pairs
    head = tok.tok.encode("ab =", add_special_tokens=False).ids
    for seq, reply in ((pair.chosen, " AB"), (pair.rejected, " cd")):
        body = tok.tok.encode(reply, add_special_tokens=False).ids
        bos = [tok.bos_id] if tok.bos_id is not None else []
        assert seq.ids.tolist() == bos + head + body + [tok.eos_id]
        assert seq.mask.tolist() == [0] * (len(bos) + len(head)) + [1] * (len(body) + 1)


def test_a_conversational_pair_trains_what_sft_trains(tiny_model):
    tok = load_tokenizer(tiny_model)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    chosen, rejected = [{"role": "assistant", "content": "4"}], \
        [{"role": "assistant", "content": "5"}]
    path = tiny_model.parent / "chat-pairs.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n"
                    + json.dumps({"chosen": prompt + chosen, "rejected": prompt + rejected}) + "\n")
    explicit, implicit = read_pairs(DataConfig(train=str(path), max_seq_len=512), tok).pairs
    sft = encode_chats(tok, ChatRenderer(tok), [Conversation(prompt + chosen, (False,) * 4 + (True,))],
                       "assistant")
    for pair in (explicit, implicit):
        assert pair.chosen.ids.tolist() == sft.ids.tolist()
        assert pair.chosen.mask.tolist() == sft.mask.tolist()


@pytest.mark.parametrize("record, says", [
    ({"prompt": "a", "chosen": "b"}, "has no 'rejected' reply"),
    ({"prompt": "a", "chosen": "b", "rejected": "b"}, "the same text"),
    ({"prompt": "a", "completion": "b", "label": True}, "train.objective = \"kto\""),
    ({"prompt": "a " * 40, "chosen": "b", "rejected": "c"}, "leaves no room for the reply"),
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]},
     "mixes a string reply"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, "must hold one assistant message"),
    ({"chosen": "b", "rejected": "c"}, "'prompt' is missing"),
    ({"prompt": "a", "completion": "b", "label": "yes", "_kto": True}, "not true or false"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "_kto": True}, "holds a pair"),
    ({"prompt": "a", "label": True, "_kto": True}, "has no 'completion'"),
])
def test_bad_records_are_refused_naming_the_record(make, root, record, says):
    kto = record.pop("_kto", False)
    bad = root / f"bad-{abs(hash(says))}.jsonl"
    good = json.dumps({"prompt": "x =", "completion": " X", "label": True} if kto else
                      {"prompt": "x =", "chosen": " X", "rejected": " y"})
    bad.write_text(good + "\n" + json.dumps(record) + "\n")
    cfg = make(f"bad-{abs(hash(says))}", data__train=str(bad),
               train__objective="kto" if kto else "dpo")
    with pytest.raises(UserError) as e:
        run_training(cfg)
    assert str(e.value).startswith(f"{bad}:2") and says in str(e.value)
    assert not (Path(cfg.output.run_dir) / "checkpoints").exists()


def test_preference_settings_that_cannot_work_are_refused(make):
    from slideformer.engine.validate import validate
    for over, key in (({"train.objective": "ppo"}, "train.objective"),
                      ({"data.val_fraction": 0.1}, "data.val_fraction"),
                      ({"preference.beta": 0.0}, "preference.beta"),
                      ({"preference.loss": "sigmod"}, "preference.loss")):
        with pytest.raises(UserError) as e:
            validate(config_mod.override(make("refused"), over))
        assert str(e.value).startswith(key)


def test_data_inspect_pairs_shows_the_responses(tiny_run, root, capsys):
    from slideformer.engine.cli import main
    model = tiny_run(root / "runs" / "unused").model.path
    assert main(["data", "inspect", str(root / "pairs.jsonl"), "--model", model, "--pairs",
                 "--samples", "1", "--max-seq-len", "32"]) == 0
    out = capsys.readouterr().out
    first = json.loads((root / "pairs.jsonl").read_text().splitlines()[0])
    assert "pairs       160 (plain strings)" in out
    assert f"[[{first['chosen']}" in out and f"[[{first['rejected']}" in out
    assert main(["data", "inspect", str(root / "pairs.jsonl"), "--model", model]) == 2
    assert "--objective dpo" in capsys.readouterr().err


def test_data_inspect_kto_shows_each_reply_with_its_label(tiny_run, root, capsys):
    from slideformer.engine.cli import main
    model = tiny_run(root / "runs" / "unused").model.path
    records = [json.loads(line) for line in (root / "kto.jsonl").read_text().splitlines()]
    good = sum(r["label"] for r in records)
    assert main(["data", "inspect", str(root / "kto.jsonl"), "--model", model, "--kto",
                 "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert f"replies     {len(records)} (plain strings): {good} desirable, " \
           f"{len(records) - good} undesirable" in out
    first = "desirable" if records[0]["label"] else "undesirable"
    assert f"kto.jsonl:1, {first} (the response" in out and f"[[{records[0]['completion']}" in out
    assert main(["data", "inspect", str(root / "kto.jsonl"), "--model", model]) == 2
    assert "--kto" in capsys.readouterr().err
