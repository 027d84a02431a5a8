"""One check of a run config: the type, range or choice of every field, with one message each.

:func:`validate` is what every front door calls before anything is read or allocated (the CLI's
``train`` and ``plan``, the planner, the Trainer, the desktop app through ``slideformer.engine.api``). It only
looks at the values: whether files and folders exist, fit the machine or match a checkpoint is
checked where they are used. A bad value raises :class:`UserError` naming the key
(``section.name``), what is wrong and the fix.

Upper bounds are far above any real run and exist so that an absurd value is refused at once
instead of reaching code that allocates, loops or searches in proportion to it (a micro-batch of
10**8 made the planner's batch search and the packer run for minutes).
"""
from __future__ import annotations

import math
import re
import types
from dataclasses import fields
from typing import get_origin, get_type_hints

from slideformer.engine.config import METHODS, OBJECTIVES, RunConfig, parse_bytes
from slideformer.engine.devices import PRECISIONS
from slideformer.engine.errors import UserError

MAX_SEQ_LEN = 1 << 20
"""Tokens per sequence: 1M, 8x the longest context of the supported families."""
MAX_BATCH = 1 << 16
"""Sequences per micro-batch, and micro-batches per step."""
MAX_TOKENS = 1 << 24
"""Tokens per micro-batch: their hidden states alone fill 128 GiB at hidden size 4096."""
MAX_STEPS = 10**9
MAX_EPOCHS = 10**6
MAX_COUNT = 10**6
"""Slots, GPU layers, kept checkpoints, save/eval intervals, warmup steps."""
MAX_SEED = 2**63 - 1
MAX_GPUS = 64
"""GPUs of one host."""
MAX_LR = 1.0
"""AdamW moves each weight by about lr per step: above 1 every run diverges."""

COMPUTE_DTYPES = ("auto", "bfloat16", "float32")
MOMENTS_DTYPES = ("float32", "bfloat16", "int8")
PLACEMENTS = ("auto", "gpu", "host")
PURPOSES = {"train": ("model.path", "data.train"), "plan": ("model.path",), "values": ()}
PATHS = ("model.path", "data.train", "data.validation", "output.run_dir", "budget.nvme_dir")
_HOW = {"model.path": "pass --model DIR or set [model] path in the run config",
        "data.train": "pass --data FILE or set [data] train in the run config"}


def validate(cfg: RunConfig, purpose: str = "train") -> RunConfig:
    """Check every field of ``cfg``; returns it unchanged, or raises :class:`UserError`.

    Args:
        purpose: ``train`` (model and data must be set), ``plan`` (the model must be set) or
            ``values`` (only the values that are given are checked).
    """
    _check_types(cfg)
    for key in PURPOSES[purpose]:
        if not _get(cfg, key):
            raise UserError(key, "is not set", _HOW[key])
    for key in PATHS:
        _check_utf8(key, _get(cfg, key))
    _check_data(cfg)
    _check_optim(cfg)
    _check_train(cfg)
    _check_budget(cfg)
    if not cfg.output.run_dir.strip():
        raise UserError("output.run_dir", "is empty", "give the folder of the run, e.g. runs/run")
    if parse_bytes(cfg.output.shard_size, "output.shard_size") <= 0:
        raise UserError("output.shard_size", "is not a positive size", "e.g. 5GiB")
    return cfg


def _check_utf8(key: str, path: str) -> None:
    """A path setting must be text: the run's config.toml and events store it as UTF-8."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = path.encode("utf-8", "backslashreplace").decode()
        raise UserError(key, f"names {shown!r}, which is not a UTF-8 name",
                        "rename the file or folder to a UTF-8 name") from None


def _get(cfg: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _check_types(cfg: RunConfig) -> None:
    """Each field holds its declared type (a RunConfig built in code skips config.from_dict)."""
    for sec in fields(RunConfig):
        section = getattr(cfg, sec.name)
        for name, typ in get_type_hints(type(section)).items():
            v = getattr(section, name)
            # tuple[str, ...] is checked as a tuple; int | str as either
            kind = typ if isinstance(typ, types.UnionType) else get_origin(typ) or typ
            ok = (isinstance(v, (int, float)) if typ is float else isinstance(v, kind))
            if not ok or (isinstance(v, bool) and typ is not bool):
                raise UserError(f"{sec.name}.{name}",
                                f"expects a {getattr(kind, '__name__', kind)}, got {v!r}",
                                "fix the value's type")


def _int(key: str, v: int, low: int, high: int, what: str = "") -> None:
    if not low <= v <= high:
        raise UserError(key, f"is {v:,}", f"give an integer from {low:,} to {high:,}{what}")


def _real(key: str, v: float, ok, rule: str) -> None:
    if not (math.isfinite(v) and ok(v)):
        raise UserError(key, f"is {v!r}", f"give a finite number {rule}")


def _choice(key: str, v: str, allowed) -> None:
    if v not in allowed:
        raise UserError(key, f"is {v!r}", f"use one of: {', '.join(allowed)}")


def _check_data(cfg: RunConfig) -> None:
    from slideformer.engine.data.prepare import check_config  # the data settings' own choices
    d = cfg.data
    _int("data.max_seq_len", d.max_seq_len, 2, MAX_SEQ_LEN, " tokens")
    _real("data.val_fraction", d.val_fraction, lambda x: 0 <= x < 1, "in [0, 1)")
    _int("data.seed", d.seed, 0, MAX_SEED)
    check_config(d)


def _check_optim(cfg: RunConfig) -> None:
    from slideformer.engine.train.schedule import SCHEDULES
    o = cfg.optim
    _real("optim.lr", o.lr, lambda x: 0 < x <= MAX_LR, f"> 0 and at most {MAX_LR:g}, e.g. 1e-5")
    _real("optim.weight_decay", o.weight_decay, lambda x: x >= 0, ">= 0, e.g. 0.01")
    for key, v in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        _real(key, v, lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.9 for beta1, 0.999 for beta2")
    _real("optim.eps", o.eps, lambda x: 0 < x < 1, "> 0 and < 1, e.g. 1e-8")
    _choice("optim.schedule", o.schedule, SCHEDULES)
    _int("optim.warmup_steps", o.warmup_steps, 0, MAX_STEPS, " steps")
    _real("optim.min_lr_ratio", o.min_lr_ratio, lambda x: 0 <= x <= 1, "in [0, 1]")
    _real("optim.max_grad_norm", o.max_grad_norm, lambda x: x >= 0,
          ">= 0 (0 turns clipping off), e.g. 1.0")
    _choice("optim.moments_dtype", o.moments_dtype, MOMENTS_DTYPES)


def _check_train(cfg: RunConfig) -> None:
    t = cfg.train
    _int("train.micro_batch", t.micro_batch, 1, MAX_BATCH, " sequences")
    _int("train.grad_accum", t.grad_accum, 1, MAX_BATCH, " micro-batches")
    tokens = t.micro_batch * cfg.data.max_seq_len
    if tokens > MAX_TOKENS:
        raise UserError("train.micro_batch", f"x data.max_seq_len is {tokens:,} tokens per "
                        f"micro-batch, more than {MAX_TOKENS:,}",
                        "lower train.micro_batch (raise train.grad_accum for the same batch)")
    _int("train.max_steps", t.max_steps, 0, MAX_STEPS, " (0: run train.epochs)")
    if not t.max_steps:
        if not (math.isfinite(t.epochs) and 0 < t.epochs <= MAX_EPOCHS):
            raise UserError("train.epochs", f"is {t.epochs!r} and train.max_steps is 0",
                            f"give a positive number of epochs up to {MAX_EPOCHS:,}, "
                            "or set train.max_steps")
    _int("train.seed", t.seed, 0, MAX_SEED)
    _choice("train.method", t.method, METHODS)
    if t.method != "full":
        from slideformer.engine.models.lora import lora_spec  # torch: only for adapter runs
        lora_spec(cfg.lora)  # rank, alpha, dropout and targets, each named when wrong
    _choice("train.compute_dtype", t.compute_dtype, COMPUTE_DTYPES)
    _choice("train.precision", t.precision, PRECISIONS)
    if t.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d{1,3}", t.device):
        raise UserError("train.device", f"{t.device!r} is not a device",
                        "use auto, cuda, cuda:N or cpu")
    _int("train.save_every", t.save_every, 0, MAX_STEPS, " steps (0: only at the end)")
    _int("train.keep_checkpoints", t.keep_checkpoints, 1, MAX_COUNT)
    _int("train.eval_every", t.eval_every, 0, MAX_STEPS, " steps (0: never)")
    _check_validation_uses(cfg)
    _check_objective(cfg)
    if t.clip_regen != "auto":
        if isinstance(t.clip_regen, str):
            raise UserError("train.clip_regen", f"is {t.clip_regen!r}",
                            "give a number of decoder layers (0: off) or \"auto\"")
        _int("train.clip_regen", t.clip_regen, 0, MAX_COUNT, " layers (or \"auto\")")
    _check_gpus(cfg)


def _check_validation_uses(cfg: RunConfig) -> None:
    """Early stopping and keep_best need evaluations to judge by; trackers must be known."""
    t, d, o = cfg.train, cfg.data, cfg.output
    _int("train.early_stopping_patience", t.early_stopping_patience, 0, MAX_COUNT,
         " evaluations (0: never stop early)")
    _real("train.early_stopping_threshold", t.early_stopping_threshold, lambda x: x >= 0, ">= 0")
    for key, on in (("train.early_stopping_patience", t.early_stopping_patience > 0),
                    ("output.keep_best", o.keep_best)):
        if on and not t.eval_every:
            raise UserError(key, "needs evaluations during the run, but train.eval_every is 0",
                            "set train.eval_every (e.g. 50 steps)")
        if on and not (d.validation or d.val_fraction > 0):
            raise UserError(key, "needs a validation split, but the run has none",
                            "set data.validation to a file, or data.val_fraction (e.g. 0.05)")
    from slideformer.engine.tracking import TRACKERS
    for i, name in enumerate(o.report_to):
        _choice(f"output.report_to[{i}]", name, TRACKERS)
    if len(set(o.report_to)) != len(o.report_to):
        raise UserError("output.report_to", f"names a tracker twice ({list(o.report_to)})",
                        "list each tracker once")


PREFERENCE_LOSSES = ("sigmoid", "hinge", "ipo")


def _check_grpo(cfg: RunConfig) -> None:
    """The [grpo] section (its values whatever the objective; the group against the step)."""
    g, t = cfg.grpo, cfg.train
    _int("grpo.group_size", g.group_size, 2, 1 << 12, " (a group of one has no spread)")
    _int("grpo.prompts_together", g.prompts_together, 1, 1 << 12, "")
    _int("grpo.max_new_tokens", g.max_new_tokens, 1, 1 << 16)
    _real("grpo.temperature", g.temperature, lambda x: 0 < x <= 100, "above 0 (at most 100)")
    _real("grpo.top_p", g.top_p, lambda x: 0 < x <= 1, "in (0, 1]")
    _real("grpo.kl_beta", g.kl_beta, lambda x: 0 <= x <= 100, "at least 0 (at most 100)")
    if g.kl_beta and t.objective == "grpo" and t.method == "full":
        raise UserError("grpo.kl_beta", f"is {g.kl_beta:g}, but a full fine-tune has no "
                        "reference model here (the initial weights would need a second copy "
                        "of the model)", "set grpo.kl_beta = 0, or train.method = \"lora\" or "
                        "\"qlora\" (the base with the adapters off is the reference)")
    if not isinstance(g.answer_regex, str) or not isinstance(g.reward, str):
        raise UserError("grpo.answer_regex", "and grpo.reward must be text", "quote them")
    try:
        re.compile(g.answer_regex)
    except re.error as e:
        raise UserError("grpo.answer_regex", f"is not a regular expression ({e})",
                        "fix the pattern (Python's re syntax)") from None
    if t.objective == "grpo" and (t.micro_batch * t.grad_accum) % g.group_size:
        raise UserError("train.micro_batch", f"x train.grad_accum = {t.micro_batch * t.grad_accum}"
                        f" replies a step, not a whole number of groups of grpo.group_size = "
                        f"{g.group_size}", "make micro_batch x grad_accum a multiple of the group "
                        "size")


def _check_objective(cfg: RunConfig) -> None:
    """train.objective, the [preference] and [grpo] sections; what such a run cannot do yet."""
    t, p = cfg.train, cfg.preference
    _choice("train.objective", t.objective, OBJECTIVES)
    _check_grpo(cfg)
    _real("preference.beta", p.beta, lambda x: 0 < x <= 1e3, "above 0 (and at most 1000)")
    _real("preference.gamma", p.gamma, lambda x: abs(x) <= 1e3, "from -1000 to 1000")
    for key in ("desirable_weight", "undesirable_weight"):
        _real(f"preference.{key}", getattr(p, key), lambda x: 0 < x <= 1e3,
              "above 0 (and at most 1000)")
    _choice("preference.loss", p.loss, PREFERENCE_LOSSES)
    _choice("preference.reference", p.reference, ("initial",))
    if t.objective == "sft":
        return
    d = cfg.data
    for key, bad, fix in (
            ("data.validation", bool(d.validation), "remove data.validation"),
            ("data.val_fraction", d.val_fraction > 0, "set data.val_fraction = 0"),
            ("train.eval_every", t.eval_every > 0, "set train.eval_every = 0"),
            ("data.mix", bool(d.mix), "put the pairs in one file (data.train)")):
        if bad:
            raise UserError(key, f"is not supported with train.objective = {t.objective!r} yet",
                            fix)
    if t.gpus not in (1,):
        raise UserError("train.gpus", f"is {t.gpus!r}: preference objectives run on one GPU",
                        "set train.gpus = 1")


def _check_gpus(cfg: RunConfig) -> None:
    """train.gpus: a count or "all"; several GPUs share a step's micro-batches and the host
    optimizer (full fine-tuning, every update on the host)."""
    t, b = cfg.train, cfg.budget
    if t.gpus == "all":
        return
    if isinstance(t.gpus, str):
        raise UserError("train.gpus", f"is {t.gpus!r}", "give a number of GPUs or \"all\"")
    _int("train.gpus", t.gpus, 1, MAX_GPUS, " (or \"all\")")
    if t.gpus == 1:
        return
    if t.grad_accum % t.gpus:
        raise UserError("train.grad_accum", f"is {t.grad_accum}: {t.gpus} GPUs (train.gpus) "
                        "cannot share its micro-batches evenly",
                        f"make train.grad_accum a multiple of {t.gpus}")
    for key, bad, why in (("train.device", t.device.startswith("cuda:"), "cuda (GPUs 0..N-1)"),
                          ("train.method", t.method != "full", "full"),
                          ("budget.nvme_dir", bool(b.nvme_dir), "\"\" (no NVMe tier)"),
                          ("budget.gpu_layers", b.gpu_layers > 0, "0 or -1")):
        if bad:
            raise UserError(key, f"is not supported with train.gpus = {t.gpus} yet",
                            f"set {key} = {why}, or train.gpus = 1")


def _check_budget(cfg: RunConfig) -> None:
    b = cfg.budget
    for key, text in (("budget.vram", b.vram), ("budget.ram", b.ram)):
        if text.strip().lower() != "auto" and parse_bytes(text, key) <= 0:
            raise UserError(key, f"{text!r} is not a positive size",
                            "give a size such as 24GiB, or auto")
    _int("budget.slots", b.slots, 0, MAX_COUNT, " (0: the planner's choice)")
    _choice("budget.checkpoints", b.checkpoints, PLACEMENTS)
    _int("budget.gpu_layers", b.gpu_layers, -1, MAX_COUNT,
         " (-1: the planner's choice, 0: none)")
    if b.nvme_size.strip().lower() not in ("", "auto"):
        size = parse_bytes(b.nvme_size, "budget.nvme_size")
        if size > 0 and not b.nvme_dir:
            raise UserError("budget.nvme_size", f"is {b.nvme_size} but no folder is given",
                            "set budget.nvme_dir (or --disk PATH:SIZE)")
