"""What a resumed run may change: every setting a checkpoint depends on, decided once.

A checkpoint holds a state that only means something under some of the run's settings: the
shapes and dtypes of its tensors (train.method, lora.rank, optim.moments_dtype, the compute
dtype), the function its adapters add (lora.alpha), and the rows its data position counts (the
data settings, train.micro_batch, train.grad_accum). :data:`RULES` decides each key of the run
config: a refused change stops ``--resume`` with one message naming the setting, its value in
the checkpoints and now, and what to do, before anything is written into the run folder; an
allowed one resumes with a warning that lists it. tests/engine/train/test_resume_settings.py
checks that every key has a rule and that every refused key is refused.

Besides the settings, a checkpoint records what it was trained from (:func:`depends`): the
model (config.json's figures, tokenizer.json's digest), the dtype train.compute_dtype resolved
to on its device, and the digest of each training source (its files' names and bytes, the token
cache's key). Those are compared too, so a data file edited in place is refused while one moved
to another folder is not.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from slideformer.engine import config as config_mod
from slideformer.engine.config import RunConfig
from slideformer.engine.devices import compute_dtype_name
from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec


@dataclass(frozen=True)
class Rule:
    refuse: bool
    """A change stops the resume (else: resumed with a warning)."""
    why: str
    """What the setting decides (refused), or why the state stays valid (allowed)."""


_DATA_ROWS = "and so the rows the checkpoint's data position counts"
_SAFE_OPTIM = "a hyperparameter of the updates to come; the state stays the same AdamW state"
_PLACEMENT = "only where the state lives while training; the steps are the same"
RULES: dict[str, Rule] = {
    "model.path": Rule(False, "a moved model folder; the model itself (config.json's figures, "
                              "tokenizer.json's digest) must be the checkpointed one"),
    "data.train": Rule(True, "decides the data the run trains on; compared by contents and "
                             "file names (a file may move to another folder)"),
    "data.format": Rule(True, "decides how each record is read into tokens, " + _DATA_ROWS),
    "data.validation": Rule(False, "only what the validation loss is measured on"),
    "data.val_fraction": Rule(True, "decides which records are held out, " + _DATA_ROWS),
    "data.max_seq_len": Rule(True, "decides how records are cut and packed, " + _DATA_ROWS),
    "data.packing": Rule(True, "decides how records are packed, " + _DATA_ROWS),
    "data.train_on": Rule(True, "decides which tokens are trained"),
    "data.mask_history": Rule(True, "decides which tokens are trained"),
    "data.truncation": Rule(True, "decides which records are kept, " + _DATA_ROWS),
    "data.max_samples": Rule(True, "decides which records are read, " + _DATA_ROWS),
    "data.chat_template": Rule(True, "decides the tokens of every conversation"),
    "data.enable_thinking": Rule(True, "decides the tokens of every conversation"),
    "data.ignore_fields": Rule(False, "only whether records with such fields are refused; a "
                                      "started run read none of them"),
    "data.seed": Rule(True, "decides the order of the rows"),
    "data.columns": Rule(True, "decides which fields are read into tokens"),
    "data.mix": Rule(True, "decides the mixed sources and their shares; compared by contents "
                           "and file names (a file may move to another folder)"),
    "optim.lr": Rule(False, _SAFE_OPTIM),
    "optim.weight_decay": Rule(False, _SAFE_OPTIM),
    "optim.beta1": Rule(False, _SAFE_OPTIM),
    "optim.beta2": Rule(False, _SAFE_OPTIM),
    "optim.eps": Rule(False, _SAFE_OPTIM),
    "optim.schedule": Rule(False, _SAFE_OPTIM),
    "optim.warmup_steps": Rule(False, _SAFE_OPTIM),
    "optim.min_lr_ratio": Rule(False, _SAFE_OPTIM),
    "optim.max_grad_norm": Rule(False, _SAFE_OPTIM),
    "optim.moments_dtype": Rule(True, "decides the format of the AdamW moments the checkpoint "
                                         "holds (float32, bfloat16 or 8-bit blocks: other "
                                         "dtypes and sizes)"),
    "train.micro_batch": Rule(True, "decides, with train.grad_accum, the rows of each step, "
                                    + _DATA_ROWS),
    "train.grad_accum": Rule(True, "decides, with train.micro_batch, the rows of each step, "
                                   + _DATA_ROWS),
    "train.max_steps": Rule(False, "the length of the run (and of its learning-rate schedule)"),
    "train.epochs": Rule(False, "the length of the run (and of its learning-rate schedule)"),
    "train.seed": Rule(False, "only LoRA's dropout masks from here on; the state is restored"),
    "train.compute_dtype": Rule(True, "decides the dtype of the weights the checkpoint holds; "
                                      "compared as the dtype it resolves to (auto: bfloat16 on "
                                      "a GPU, float32 on the CPU)"),
    "train.precision": Rule(False, "only the dtype of the residual stream while training"),
    "train.device": Rule(False, "where the run computes (the compute dtype it implies is "
                                "compared)"),
    "train.objective": Rule(True, "decides the loss, the data (records or pairs) and the "
                                  "reference the state was trained against"),
    "train.method": Rule(True, "decides what the checkpoint holds (every weight, or adapters)"),
    "train.save_every": Rule(False, "only when checkpoints are written"),
    "train.keep_checkpoints": Rule(False, "only how many checkpoints are kept (older ones go "
                                          "when the run resumes)"),
    "train.eval_every": Rule(False, "only when the validation loss is measured"),
    "train.early_stopping_patience": Rule(False, "only when the run stops"),
    "train.early_stopping_threshold": Rule(False, "only when the run stops"),
    "train.gpus": Rule(False, "only how the micro-batches of each step are shared among "
                              "processes; the steps are the same"),
    "train.clip_regen": Rule(False, "only which gradients are recomputed rather than kept "
                                    "(exact); the steps are the same"),
    "lora.rank": Rule(True, "decides the shape of every adapter the checkpoint holds"),
    "lora.alpha": Rule(True, "scales what every adapter adds (alpha / rank): the same "
                             "adapters would be another model"),
    "lora.dropout": Rule(False, "only the dropout of the steps to come"),
    "lora.target_modules": Rule(True, "decides which adapters the checkpoint holds"),
    "lora.use_rslora": Rule(True, "scales what every adapter adds (alpha / sqrt(rank)): the "
                                  "same adapters would be another model"),
    "lora.export_merged": Rule(False, "only what the final export writes"),
    "preference.beta": Rule(False, "a hyperparameter of the loss to come"),
    "preference.loss": Rule(False, "the loss of the steps to come"),
    "preference.reference": Rule(True, "decides the reference log-probabilities the run "
                                       "computed before its first step"),
    "preference.gamma": Rule(False, "a hyperparameter of the loss to come"),
    "preference.desirable_weight": Rule(False, "a hyperparameter of the loss to come"),
    "preference.undesirable_weight": Rule(False, "a hyperparameter of the loss to come"),
    "grpo.group_size": Rule(False, "a setting of the steps to come"),
    "grpo.max_new_tokens": Rule(False, "a setting of the steps to come"),
    "grpo.temperature": Rule(False, "a setting of the steps to come"),
    "grpo.top_p": Rule(False, "a setting of the steps to come"),
    "grpo.reward": Rule(False, "the reward of the steps to come"),
    "grpo.answer_regex": Rule(False, "the reward of the steps to come"),
    "grpo.kl_beta": Rule(False, "a hyperparameter of the loss to come"),
    "grpo.prompts_together": Rule(False, "only how many groups are decoded at once (in bf16 "
                                         "the sampled replies may round differently)"),
    "budget.vram": Rule(False, _PLACEMENT),
    "budget.ram": Rule(False, _PLACEMENT),
    "budget.slots": Rule(False, _PLACEMENT),
    "budget.checkpoints": Rule(False, _PLACEMENT),
    "budget.gpu_layers": Rule(False, _PLACEMENT),
    "budget.nvme_dir": Rule(False, _PLACEMENT + " (the NVMe tier is filled from the checkpoint)"),
    "budget.nvme_size": Rule(False, _PLACEMENT),
    "output.run_dir": Rule(False, "a moved or copied run folder"),
    "output.shard_size": Rule(False, "only how the final export is split"),
    "output.keep_best": Rule(False, "only which checkpoint is kept besides the newest"),
    "output.report_to": Rule(False, "only where the metrics also go"),
}
"""Every key of the run config: refused, or allowed with the warning."""
COMPARED_OTHERWISE = {"data.train", "data.mix", "train.compute_dtype"}
"""Refused keys whose value may change as long as what it stands for does not: the sources'
contents (and mixing), and the dtype the compute dtype resolves to (:func:`depends`)."""


def depends(cfg: RunConfig, device: str, sources: list | None) -> dict:
    """What a checkpoint of this run records besides its settings (stored in trainer.json).

    Args:
        device: ``cuda`` or ``cpu``, what train.compute_dtype resolves on.
        sources: ``slideformer.engine.data.prepare.source_digests`` of the run's data (None: the
            data came from the caller, not from data.train).
    """
    return {"model": model_figures(cfg.model.path),
            "compute_dtype": compute_dtype_name(cfg.train.compute_dtype, device),
            "sources": sources}


def model_figures(model_dir: str) -> dict:
    """The model a checkpoint belongs to: config.json's figures (as ``info`` shows them) and its
    tokenizer.json's digest (another tokenizer makes other token sequences)."""
    tok = Path(model_dir) / "tokenizer.json"
    digest = hashlib.sha256(tok.read_bytes()).hexdigest()[:16] if tok.is_file() else None
    return {**{k: v for k, v in load_spec(model_dir).summary().items() if k != "dtype"},
            "tokenizer.json sha256": digest}


def check(meta: dict, cfg: RunConfig, now: dict) -> None:
    """Refuse to continue the checkpoint of trainer state ``meta`` with ``cfg``.

    Args:
        now: :func:`depends` of this run.

    Raises:
        UserError: another model; or one message naming every refused setting that changed.
    """
    _check_model(meta.get("model"), now["model"], cfg.model.path, meta)
    old = meta.get("config", {})
    refused = [(key, was, value) for key, was, value in _changes(old, config_mod.to_dict(cfg))
               if _rule(key).refuse and _setting(key) not in COMPARED_OTHERWISE
               and _applies(key, old)]
    if refused:
        raise _refusal(refused)
    was = meta.get("compute_dtype")
    if was is not None and was != now["compute_dtype"]:
        raise UserError("train.compute_dtype", f"is {json.dumps(cfg.train.compute_dtype)}, "
                        f"which computes in {now['compute_dtype']} here, but the run's "
                        f"checkpoints hold a {was} state: it {RULES['train.compute_dtype'].why}",
                        f"resume with train.compute_dtype = \"{was}\", or start a new run "
                        "without --resume in another output.run_dir")
    if meta.get("sources") is not None and now["sources"] is not None:
        _check_sources(meta["sources"], now["sources"])


def changes(old: dict, new: dict) -> list[str]:
    """``key old -> new`` of every setting that differs (config dicts, as in trainer.json)."""
    return [f"{key} {was!r} -> {value!r}" for key, was, value in _changes(old, new)]


def _changes(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(key, old, new) of each changed value; a table's keys one by one (data.columns.prompt)."""
    out = []
    for k, v in new.items():
        if k not in old or old[k] == v:
            continue
        if isinstance(v, dict) and isinstance(old[k], dict):
            out += _changes(old[k], v, f"{prefix}{k}.")
        else:
            out.append((prefix + k, old[k], v))
    return out


def _setting(key: str) -> str:
    """The key of RULES a changed value belongs to (data.columns.prompt: data.columns)."""
    return ".".join(key.split(".")[:2])


def _rule(key: str) -> Rule:
    return RULES[_setting(key)]


def _applies(key: str, old: dict) -> bool:
    """A section's settings only matter to the runs that use it (lora, preference)."""
    train = old.get("train", {})
    if key.startswith("lora."):
        return train.get("method", "full") != "full"
    if key.startswith("preference."):
        return train.get("objective", "sft") not in ("sft", "grpo")
    if key.startswith("grpo."):
        return train.get("objective", "sft") == "grpo"
    return True


def _refusal(refused: list[tuple[str, object, object]]) -> UserError:
    new_run = "or start a new run with the new values (without --resume, in another output.run_dir)"
    if len(refused) == 1:
        (key, was, value), = refused
        return UserError(key, f"was {json.dumps(was)} when the run's checkpoints were written, "
                         f"now {json.dumps(value)}: it {_rule(key).why}",
                         f"resume with {key} = {json.dumps(was)}, {new_run}")
    return UserError(", ".join(k for k, _, _ in refused),
                     "changed since the run's checkpoints were written: " + "; ".join(
                         f"{k} {json.dumps(w)} -> {json.dumps(v)} (it {_rule(k).why})"
                         for k, w, v in refused),
                     "resume with the values of the checkpointed run (" + ", ".join(
                         f"{k} = {json.dumps(w)}" for k, w, _ in refused) + f"), {new_run}")


def _check_model(old: dict | None, new: dict, model_dir: str, meta: dict) -> None:
    if old is None or old == new:
        return
    diffs = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v]
    was = meta.get("config", {}).get("model", {}).get("path", "?")
    raise UserError(Path(model_dir) / "config.json",
                    "describes another model than the one this run's checkpoints were "
                    f"trained from ({', '.join(diffs)})",
                    f"resume with the model of the checkpointed run ({was}), or start "
                    "a new run folder without --resume")


def _check_sources(old: list, new: list) -> None:
    """The training sources: the same contents and mixing, in the same order."""
    fix = ("resume with the data the checkpointed run trained on, or start a new run on this "
           "data (without --resume, in another output.run_dir)")
    if len(old) != len(new):
        raise UserError("data.mix", f"mixes {len(new) - 1} source(s) into data.train, the "
                        f"checkpointed run {len(old) - 1}: it {RULES['data.mix'].why}", fix)
    for (setting, was_path, was, *was_mix), (_, path, digest, *mix) in zip(old, new):
        if digest != was:
            moved = "" if path == was_path else f" (the checkpointed run read {was_path})"
            raise UserError(setting, f"{path}: its contents are not those the run's "
                            f"checkpoints were trained on{moved}", fix)
        if mix != was_mix:
            raise UserError(setting, f"is mixed with (weight, samples) = {tuple(mix)}, the "
                            f"checkpointed run's with {tuple(was_mix)}: data.mix "
                            f"{RULES['data.mix'].why}", fix)
