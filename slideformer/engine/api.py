"""The engine's front door: everything the desktop app and the command line call.

Everything else in ``engine/`` is free to change without touching a front end. The names here
are the engine's promise:

- **Run configs**: :class:`RunConfig` and its sections, :func:`load_config`,
  :func:`config_from_dict`, :func:`validate_config`, :func:`override`, :func:`dumps`.
- **Plans**: :func:`plan_for_config` (what ``slideformer plan`` and the Plan page show), the GPU
  presets (:data:`PRESETS`), the machine as the planner sees it (:func:`gpu_memory`,
  :func:`host_memory`, :func:`load_profile`, :func:`run_device`, :func:`resolve_budgets`) and the
  plan's parts.
- **Models**: :func:`inspect_model` (``slideformer info``, the Model page), :func:`make_tiny_model`,
  :func:`discover_models` (``slideformer models``, the Model page's "On this machine") in the
  stores :func:`model_roots` names.
- **GGUF and Ollama**: :func:`gguf_export_path` (where ``slideformer export-gguf`` writes),
  :func:`send_to_ollama` (``ollama create`` from an exported GGUF, or how to do it by hand).
- **Data**: :func:`analyse_data` (``slideformer data inspect``, the Data page); preference
  pairs, KTO's labelled replies and GRPO's prompts (``data inspect --pairs`` / ``--kto`` /
  ``--prompts``): :func:`records_kind`,
  :func:`describe_pairs`, :func:`describe_prompts`.
- **Runs**: :class:`RunClient` starts, follows, pauses, resumes and stops a run through its
  folder, whoever started it; the event dataclasses are what its ``events.jsonl`` holds.
- **Errors**: :class:`UserError`, one message for people (what, where, how to fix).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slideformer.engine import __version__
from slideformer.engine import config as _config
from slideformer.engine.config import (BudgetConfig, DataConfig, ModelConfig, OptimConfig, OutputConfig,
                           RunConfig, TrainConfig, dumps, format_bytes, override,
                           parse_bytes)
from slideformer.engine.config import to_dict as config_to_dict
from slideformer.engine.data import DataStats, Sample
from slideformer.engine.data.preview import Preview
from slideformer.engine.data.commands import sample_counts
from slideformer.engine.data.analysis import DataAnalysis, analyse_data
from slideformer.engine.data.formats import FORMATS, PREFERENCE_KEYS
from slideformer.engine.data.preference import PairReport
from slideformer.engine.data.preference import describe_pairs as _describe_pairs
from slideformer.engine.data.records import RecordReader, source_files
from slideformer.engine.errors import UserError
from slideformer.engine.gguf.commands import default_out as gguf_export_path
from slideformer.engine.gguf.installed import SMOLLM2_INSTALL, smollm2_gguf
from slideformer.engine.gguf.kinds import EXPORT_KINDS as GGUF_EXPORT_TYPES
from slideformer.engine.gguf.ollama import OllamaResult, send_to_ollama
from slideformer.engine.gguf.ollama import default_name as ollama_model_name
from slideformer.engine.validate import validate
from slideformer.engine.events import (CheckpointSaved, EvalMetrics, Log, PairMetrics, Progress,
                                      RolloutMetrics, RunState, Span,
                           StepMetrics, Timeline, from_json, read_events)
from slideformer.engine.models.commands import format_count, model_report as inspect_model
from slideformer.engine.models.discover import Fit, FoundModel, discover_models
from slideformer.engine.models.stores import Roots as ModelRoots
from slideformer.engine.models.stores import default_roots as model_roots
from slideformer.engine.models.spec import SUPPORTED, ModelSpec, load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.engine.plan import (PRESETS, REFERENCE, Allocation, Budgets, Fix, HardwareProfile, Plan,
                         TierUse, load_profile, resolve_budgets)
from slideformer.engine.plan.machine import GpuMemory, HostMemory, gpu_memory, host_memory
from slideformer.engine.plan.planner import plan_run, run_device
from slideformer.engine.train.checkpoint import checkpoints
from slideformer.engine.train.client import (CONFIG_FILE, EVENTS_FILE, LOG_FILE, TERMINAL_STATES, EventReader,
                                 RunClient, engine_command, engine_env, train_argv)
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.demo import write_task

__all__ = [
    "__version__",
    # run configs
    "BudgetConfig", "DataConfig", "ModelConfig", "OptimConfig", "OutputConfig", "RunConfig",
    "TrainConfig", "config_from_dict", "config_to_dict", "dumps", "format_bytes", "load_config", "override",
    "parse_bytes",
    "parse_toml", "validate_config",
    # errors
    "UserError",
    # events
    "CheckpointSaved", "EvalMetrics", "Log", "PairMetrics", "Progress", "RolloutMetrics", "RunState",
    "Span", "StepMetrics",
    "Timeline", "from_json", "read_events",
    # plans and the machine
    "PRESETS", "REFERENCE", "Allocation", "Budgets", "Fix", "GpuMemory", "HardwareProfile",
    "HostMemory", "Plan", "TierUse", "gpu_memory", "host_memory", "load_profile", "plan_for_config",
    "resolve_budgets", "suggest_settings",
    "run_device",
    # models
    "SUPPORTED", "ModelSpec", "TinyShape", "inspect_model", "load_spec", "load_tokenizer",
    "make_tiny_model", "Fit", "FoundModel", "ModelRoots", "discover_models", "format_count",
    "model_roots",
    # GGUF files, Ollama and the SmolLM2 demo model
    "GGUF_EXPORT_TYPES", "SMOLLM2_INSTALL", "gguf_export_path", "smollm2_gguf",
    "OllamaResult", "ollama_model_name", "send_to_ollama",
    # data
    "FORMATS", "DataAnalysis", "DataStats", "PairReport", "Preview", "PromptReport", "Sample",
    "analyse_data", "describe_pairs", "describe_prompts", "records_kind", "sample_counts",
    "write_task",
    # runs
    "CONFIG_FILE", "EVENTS_FILE", "LOG_FILE", "TERMINAL_STATES", "EventReader", "RunClient",
    "checkpoints", "engine_command", "engine_env", "run_training", "train_argv",
]


# ---- run configs ---------------------------------------------------------------------------------
def validate_config(cfg: RunConfig, purpose: str = "values") -> RunConfig:
    """Check every field of a run config (types, ranges, choices); returns it unchanged.

    Args:
        purpose: ``train`` (model and data must be set), ``plan`` (the model must be set) or
            ``values`` (only the values that are given are checked).

    Raises:
        UserError: naming the first bad field (``section.key``) and how to fix it.
    """
    return validate(cfg, purpose)


def load_config(path: Path | str) -> RunConfig:
    """Read and check a run ``.toml`` file."""
    return validate_config(_config.load(path))


def config_from_dict(data: dict[str, Any], source: str = "config",
                     validate: bool = True) -> RunConfig:
    """A run config from ``{"model": {"path": ...}, ...}`` (the TOML file's layout).

    Unknown keys and values of the wrong type are always errors; ``validate=False`` skips the
    checks of values against each other (for a partial config such as a preset).
    """
    cfg = _config.from_dict(data, source)
    return validate_config(cfg) if validate else cfg


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """The tables of a TOML text (a run config or a preset), without checking them.

    Raises:
        UserError: the text is not TOML.
    """
    try:
        return _config.tomllib.loads(text)
    except _config.tomllib.TOMLDecodeError as e:
        raise UserError(source, f"is not valid TOML ({e})", "fix the file's syntax") from None


# ---- plans ---------------------------------------------------------------------------------------
def suggest_settings(model_path: str, hardware: HardwareProfile | str = "this",
                     settings: dict | None = None):
    """Known-good first settings for a model on a machine (slideformer.engine.plan.suggest): a
    :class:`~slideformer.engine.plan.suggest.Suggestion` of run-config keys and their reasons.
    ``settings`` (run-config keys) are kept where the suggestion has no say (budgets, device)."""
    from slideformer.engine.plan.suggest import suggest
    cfg = override(RunConfig(), {"model.path": model_path, **(settings or {})})
    return suggest(cfg, load_spec(model_path), hardware)


def plan_for_config(cfg: RunConfig, hardware: HardwareProfile | str = "this") -> Plan:
    """Where every byte of ``cfg``'s run goes, whether it fits and how fast it runs.

    Reads only the model's ``config.json``. ``hardware``: a profile, or the machine to plan for
    (slideformer.engine.plan.targets.load_profile): ``this`` machine, a GPU preset key of :data:`PRESETS`
    (``rtx4090``) or a profile JSON file.
    """
    if not cfg.model.path:
        raise UserError("model.path", "is missing", "choose a model folder (with config.json)")
    return plan_run(cfg, load_spec(cfg.model.path), hardware=hardware)


# ---- data ----------------------------------------------------------------------------------------
_REPLY_KEYS = ("completion", "response", "output", "text", "messages")
"""Fields that make a record with a prompt and an answer something other than GRPO's prompt (as
slideformer.engine.data.formats refuses it)."""


def records_kind(cfg: DataConfig) -> str:
    """Which reader shows ``cfg.train``, from its first record: ``"pairs"`` (TRL's prompt,
    chosen, rejected: :func:`describe_pairs`), ``"kto"`` (TRL's prompt, completion, label:
    :func:`describe_pairs` with ``kto``), ``"prompts"`` (a prompt and its answer:
    :func:`describe_prompts`), or ``"sft"`` (:func:`analyse_data`, which refuses what it does
    not read with its own message). The first two are the records supervised fine-tuning
    refuses as preference pairs and as GRPO's prompts.

    Raises:
        UserError: the file is missing, empty or its first record unreadable.
    """
    first = next(iter(RecordReader(source_files(cfg.train), 1)))
    v = first.value
    if not isinstance(v, dict):
        return "sft"
    if any(v.get(k) is not None for k in PREFERENCE_KEYS):
        return "pairs"
    if v.get("kto_tag") is not None or (v.get("label") is not None
                                        and ("completion" in v or "prompt" in v)):
        return "kto"
    if v.get("prompt") is not None and v.get("answer") is not None \
            and not any(k in v for k in _REPLY_KEYS):
        return "prompts"
    return "sft"


def describe_pairs(cfg: DataConfig, model_path: Path | str, samples: int = 3,
                   kto: bool = False) -> PairReport:
    """``data inspect --pairs``: ``cfg.train``'s preference pairs as train.objective dpo, orpo
    and simpo read them (counts, and the first ``samples`` pairs with their responses marked);
    ``kto`` (``--kto``): labelled replies as train.objective kto reads them.

    Raises:
        UserError: naming the first bad record (file:line), the problem and the fix.
    """
    return _describe_pairs(cfg, load_tokenizer(model_path), samples, kto)


@dataclass(frozen=True)
class PromptReport:
    """``data inspect --prompts``: GRPO's prompts, counted, and the first few."""

    prompts: int
    with_answer: int
    """Prompts with an answer for the answer check."""
    mean_tokens: float
    """Mean tokens of a prompt as the model reads it."""
    max_tokens: int
    samples: list
    """The first prompts (slideformer.engine.train.grpo.Prompt: ``text`` rendered with the chat
    template as the model continues from it, ``ids``, ``answer``, ``where``)."""


def describe_prompts(cfg: DataConfig, model_path: Path | str, samples: int = 3) -> PromptReport:
    """``data inspect --prompts``: ``cfg.train``'s prompts as train.objective grpo reads them.

    Raises:
        UserError: naming the first bad record (file:line), the problem and the fix.
    """
    from slideformer.engine.data.chat import ChatRenderer
    from slideformer.engine.train.grpo import read_prompts
    tok = load_tokenizer(model_path)
    prompts = read_prompts(cfg, tok, ChatRenderer(tok, cfg.chat_template, cfg.enable_thinking))
    lengths = [len(p.ids) for p in prompts]
    return PromptReport(len(prompts), sum(p.answer is not None for p in prompts),
                        sum(lengths) / len(lengths), max(lengths), prompts[:samples])
