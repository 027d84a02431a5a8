"""``slideformer demo``: fine-tune the tiny model on a learnable task, end to end, on any machine.

The task is reversing a short sequence of letters, written as chat pairs::

    user:      reverse: c a f e
    assistant: e f a c

A freshly initialised tiny model cannot do it; after a minute of sliding-window training (fewer
parameter slots than layers, so layers really stream) it reverses held-out sequences it never
saw. The demo prints the held-out loss and the exact-match score before and after.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from slideformer.engine.config import (BudgetConfig, DataConfig, ModelConfig, OptimConfig, OutputConfig,
                           RunConfig, TrainConfig)
from slideformer.engine.models.model import DenseModel
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.models.tokenizer import TokenizerInfo, load_tokenizer
from slideformer.engine.models.weights import Checkpoint

LETTERS = "abcdefgh"


def task_pair(rng: random.Random) -> tuple[str, str]:
    seq = [rng.choice(LETTERS) for _ in range(rng.randint(3, 5))]
    return "reverse: " + " ".join(seq), " ".join(reversed(seq))


def write_task(path: Path, n: int, seed: int) -> list[tuple[str, str]]:
    """Write ``n`` chat records of the task to a JSONL file; returns the pairs."""
    rng = random.Random(seed)
    pairs = [task_pair(rng) for _ in range(n)]
    with open(path, "w", encoding="utf-8") as f:
        for q, a in pairs:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return pairs


@dataclass(frozen=True)
class DemoPaths:
    root: Path

    @property
    def model(self) -> Path:
        return self.root / "tiny-llama"

    @property
    def train(self) -> Path:
        return self.root / "reverse-train.jsonl"

    @property
    def val(self) -> Path:
        return self.root / "reverse-val.jsonl"


def prepare_demo(root: Path, seed: int = 0) -> DemoPaths:
    """Create the tiny model and the task data under ``root`` (reused when present)."""
    paths = DemoPaths(Path(root))
    paths.root.mkdir(parents=True, exist_ok=True)
    if not (paths.model / "config.json").is_file():
        make_tiny_model(paths.model, "llama", TinyShape(layers=4, hidden=128, heads=4, kv_heads=2,
                                                        intermediate=256), seed)
    write_task(paths.train, 4000, seed + 1)
    write_task(paths.val, 200, seed + 2)
    return paths


def demo_config(paths: DemoPaths, run_dir: Path, steps: int) -> RunConfig:
    return RunConfig(
        model=ModelConfig(str(paths.model)),
        data=DataConfig(train=str(paths.train), validation=str(paths.val), max_seq_len=128),
        optim=OptimConfig(lr=3e-3, weight_decay=0.01, schedule="cosine", warmup_steps=10,
                          min_lr_ratio=0.1, max_grad_norm=1.0),
        train=TrainConfig(micro_batch=8, grad_accum=2, max_steps=steps, device="cpu"),
        budget=BudgetConfig(slots=2),
        output=OutputConfig(run_dir=str(run_dir)))


def load_dense(model_dir: Path) -> DenseModel:
    spec = load_spec(model_dir)
    model = DenseModel(spec)
    ck = Checkpoint(model_dir)
    with torch.no_grad():
        for name, p, _ in model.items():
            ck.read_item(spec, name, p.data)
    return model.eval()


@torch.no_grad()
def generate(model: DenseModel, tok: TokenizerInfo, prompt: str, max_new: int = 16) -> str:
    """Greedy answer of the model to one user message."""
    ids = tok.encode(tok.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True))
    out: list[int] = []
    for _ in range(max_new):
        logits = model.logits(torch.tensor([ids + out]))[0, -1]
        nxt = int(logits.argmax())
        if nxt == tok.eos_id:
            break
        out.append(nxt)
    return tok.decode(out).strip()


def task_score(model_dir: Path, pairs: list[tuple[str, str]]) -> float:
    """Exact-match accuracy of greedy answers on (prompt, answer) pairs."""
    model, tok = load_dense(model_dir), load_tokenizer(model_dir)
    return sum(generate(model, tok, q) == a for q, a in pairs) / len(pairs)


def held_out_loss(model_dir: Path, val_dataset, micro_batch: int = 16) -> float:
    """Mean loss per trained token of a model folder on a prepared validation set."""
    from slideformer.engine.data import iterate_eval
    model = load_dense(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for mb in iterate_eval(val_dataset, micro_batch):
            n = int((mb.labels != -100).sum())
            total += float(model.loss(mb.input_ids, mb.labels, 1.0, mb.doc_ids))
            count += n
    return total / max(count, 1)


def read_pairs(path: Path, n: int) -> list[tuple[str, str]]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines()[:n]:
        msgs = json.loads(line)["messages"]
        pairs.append((msgs[0]["content"], msgs[1]["content"]))
    return pairs
