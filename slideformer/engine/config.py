"""Run configuration: frozen dataclasses that map 1:1 onto the sections of a run TOML file.

```toml
[model]
path = "models/tiny-llama"
[data]
train = "data/train.jsonl"
[optim]
lr = 1e-4
[train]
micro_batch = 2
```
Unknown sections or keys are errors; every field has a default except ``model.path`` and
``data.train``.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from slideformer.engine.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


METHODS = ("full", "lora", "qlora")
"""train.method values."""
OBJECTIVES = ("sft", "dpo", "orpo", "simpo", "kto", "grpo")
"""train.objective values (slideformer.engine.train.objectives)."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    """Hugging Face model folder (config.json, *.safetensors, tokenizer.json)."""


@dataclass(frozen=True)
class ColumnMap:
    """Field and role names of a custom dataset (LLaMA-Factory's dataset_info idea).

    An empty string keeps the format's own name, given in brackets.
    """

    prompt: str = ""
    """Field of the instruction (Alpaca "instruction")."""
    query: str = ""
    """Field of extra input appended to the instruction (Alpaca "input")."""
    response: str = ""
    """Field of the reply (Alpaca "output")."""
    system: str = ""
    """Field of the system prompt ("system")."""
    history: str = ""
    """Field of earlier turns as [[user, assistant], ...] (Alpaca "history")."""
    messages: str = ""
    """Field of the conversation ("messages"; ShareGPT "conversations")."""
    tools: str = ""
    """Field of the tool schemas offered to the model ("tools")."""
    text: str = ""
    """Field of plain text ("text")."""
    role_tag: str = ""
    """Key of a message's role ("role"; ShareGPT "from")."""
    content_tag: str = ""
    """Key of a message's text ("content"; ShareGPT "value")."""
    user_tag: str = ""
    """A further role name that means user (e.g. "customer")."""
    assistant_tag: str = ""
    """A further role name that means assistant (e.g. "bot")."""
    system_tag: str = ""
    """A further role name that means system."""
    function_tag: str = ""
    """A further role name for an assistant's tool call (ShareGPT "function_call")."""
    observation_tag: str = ""
    """A further role name for a tool's result (ShareGPT "observation")."""


@dataclass(frozen=True)
class MixSource:
    """One more training source mixed into ``data.train`` (a ``[[data.mix]]`` table)."""

    path: str = ""
    """A data file, or a folder of .txt files."""
    weight: float = 1.0
    """Records drawn per record of the source: 2 repeats each twice, 0.5 keeps a seeded half."""
    samples: int = 0
    """Exactly this many records drawn (seeded, repeating when larger); 0: use weight."""


@dataclass(frozen=True)
class DataConfig:
    train: str = ""
    """Training data: a .txt/.jsonl/.json/.csv/.parquet/.arrow file or a folder of .txt files."""
    format: str = "auto"
    """auto, text, alpaca, messages, sharegpt (auto detects from the records)."""
    validation: str = ""
    """Optional separate validation file."""
    val_fraction: float = 0.0
    """Fraction of records held out for validation when no validation file is given."""
    max_seq_len: int = 1024
    """Tokens per sequence (plain text is cut into blocks of this many)."""
    packing: bool = True
    """Pack several records per sequence (no cross-document attention); else pad."""
    train_on: str = "assistant"
    """assistant: loss on assistant/output tokens only; all: loss on every token."""
    mask_history: bool = False
    """Train only the last assistant reply of each conversation (earlier ones are context)."""
    truncation: str = "truncate"
    """Conversations longer than max_seq_len: truncate, drop, or error."""
    max_samples: int = 0
    """Read at most this many records from each source (its first ones); 0: all."""
    chat_template: str = ""
    """Chat template: "" the model's own, "chatml", or the path of a .jinja file."""
    enable_thinking: bool = True
    """Passed to the chat template (Qwen3: false renders an empty reasoning block as prompt)."""
    ignore_fields: tuple[str, ...] = ()
    """Record fields that hold no training content (besides id-like ones) and may be ignored."""
    seed: int = 0
    """Shuffling seed."""
    columns: ColumnMap = field(default_factory=ColumnMap)
    """Field and role names of custom datasets (the ``[data.columns]`` table)."""
    mix: tuple[MixSource, ...] = ()
    """Further training sources mixed in (``[[data.mix]]`` tables)."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    schedule: str = "cosine"
    """constant, linear or cosine decay after warmup."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak (linear, cosine)."""
    max_grad_norm: float = 1.0
    """Exact global-norm clipping; 0 disables it (updates then overlap the backward)."""
    moments_dtype: str = "float32"
    """float32 (exact), bfloat16 (half the moment memory) or int8 (8-bit blocks with a scale
    each, a quarter of it); the last two change the numerics slightly."""


@dataclass(frozen=True)
class TrainConfig:
    micro_batch: int = 1
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (all processed layer-wise in one sweep)."""
    max_steps: int = 0
    """Optimizer steps; 0 means run ``epochs`` over the data."""
    epochs: float = 1.0
    seed: int = 0
    """Seed for dropout-free numerics that still need randomness (init, sampling)."""
    compute_dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32."""
    precision: str = "bf16"
    """With bfloat16 compute: bf16 (the residual stream, checkpoints, norm weights and RoPE in
    bf16: the least activation memory) or autocast (those in fp32, norms scaled in fp32 and
    rounded once for the matmuls: the numerics of torch.autocast on an fp32 model, as close to
    fp32 training; twice the checkpoint memory). No effect with float32 compute. fp8: as bf16,
    with the dense feed-forward's projections (forward and input gradient) in row-wise FP8, the
    weight gradients in bf16 (slideformer.engine.kernels.fp8): further from fp32
    (benchmarks/precision.py), and measured no faster than bf16 yet on an H100 (1.00-1.02x a 3B
    step); only on a GPU with FP8 tensor cores (RTX 40xx, L4/L40, H100/H200, B200) and a model
    with a dense MLP, refused elsewhere."""
    device: str = "auto"
    """auto, cuda or cpu."""
    objective: str = "sft"
    """sft (next-token loss on the trained tokens), or a preference objective on pairs of
    replies ({"prompt", "chosen", "rejected"} records; see [preference]): dpo (Rafailov et al.
    2023), orpo (Hong et al. 2024), simpo (Meng et al. 2024); or kto (Ethayarajh et al. 2024)
    on single replies labelled good or bad ({"prompt", "completion", "label"}).
    train.micro_batch then counts pairs (kto: labelled replies). grpo (Shao et al. 2024):
    replies sampled from the model being trained, scored by a reward ([grpo]); micro_batch
    then counts sampled replies, a step holds micro_batch x grad_accum of them, grpo.group_size
    per prompt."""
    method: str = "full"
    """full (every weight trained), lora (frozen base, trained low-rank adapters; see [lora]) or
    qlora (lora over a base quantised to 4-bit NF4 with double-quantised scales)."""
    save_every: int = 0
    """Checkpoint every N steps; 0: only at the end."""
    keep_checkpoints: int = 2
    eval_every: int = 0
    """Validation loss every N steps; 0: never (only at the end if a split exists)."""
    early_stopping_patience: int = 0
    """Stop when this many evaluations in a row did not improve on the best validation loss
    (by more than train.early_stopping_threshold), as the HF Trainer's EarlyStoppingCallback
    counts them; 0: never. Needs train.eval_every and a validation split."""
    early_stopping_threshold: float = 0.0
    """How much lower than the best validation loss a new one must be to count as an
    improvement for train.early_stopping_patience."""
    gpus: int | str = 1
    """GPUs of this machine the run uses, one process each ("all": every one); the
    micro-batches of a step are shared among them (train.grad_accum must be a multiple)."""
    clip_regen: int | str = "auto"
    """With clipping (optim.max_grad_norm > 0): how many of the lowest decoder layers keep no
    host gradient buffer and have their gradient recomputed in a second backward pass once the
    clip coefficient is known (exact; 4 B/param less host RAM, one more layer backward each per
    step). auto: the fewest that fit the host RAM budget (0 when everything fits); a number:
    that many (0: off)."""


@dataclass(frozen=True)
class LoraConfig:
    """Adapter settings of train.method = lora / qlora; names and defaults as in PEFT's
    LoraConfig (r=8, lora_alpha=8, lora_dropout=0), except that every linear projection of the
    decoder is a target by default."""
    rank: int = 8
    """r: inner dimension of each adapter (A is r x in, B is out x r)."""
    alpha: float = 8.0
    """lora_alpha: the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with
    use_rslora)."""
    dropout: float = 0.0
    """lora_dropout: dropout probability on each adapter's input."""
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated projections of every decoder layer that get an adapter (on Phi-3, any of
    q/k/v_proj means its fused qkv_proj, gate/up_proj its gate_up_proj)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(rank) (Kalajdzievski 2023)."""
    export_merged: bool = False
    """Also write final/merged: the base with the adapters folded in, a plain Hugging Face
    folder (written one layer at a time)."""


@dataclass(frozen=True)
class PreferenceConfig:
    """Settings of a preference objective (train.objective = dpo, orpo, simpo or kto)."""
    beta: float = 0.1
    """DPO's, KTO's and SimPO's beta (the inverse temperature of the implicit reward; SimPO's
    paper uses 2.0 to 2.5), ORPO's lambda (the weight of its odds-ratio term; the paper's 0.1)."""
    loss: str = "sigmoid"
    """DPO's loss of the reward margin: sigmoid (the paper's), hinge (SLiC's), or ipo (Azar et
    al. 2023: the squared distance of the log-ratio margin to 1 / (2 beta))."""
    reference: str = "initial"
    """DPO's reference model: initial, the run's starting weights (for lora / qlora the base
    with adapters off, which is the same model), evaluated once before the first step."""
    gamma: float = 0.5
    """SimPO's target reward margin (TRL's default)."""
    desirable_weight: float = 1.0
    """KTO's lambda_D: the weight of the losses of replies labelled good."""
    undesirable_weight: float = 1.0
    """KTO's lambda_U: the weight of the losses of replies labelled bad (the paper suggests
    lambda_D * n_D / (lambda_U * n_U) in [1, 4/3])."""


@dataclass(frozen=True)
class GrpoConfig:
    """Settings of train.objective = "grpo" (Group Relative Policy Optimization, Shao et al.
    2024, "DeepSeekMath"): group_size replies are sampled per prompt from the current weights,
    scored, and each reply's tokens are trained with its group-normalised advantage."""
    group_size: int = 8
    """Replies sampled per prompt (the group whose rewards normalise each other; TRL's
    num_generations)."""
    max_new_tokens: int = 64
    """The longest reply sampled (a reply ends earlier at the model's end-of-turn token)."""
    temperature: float = 1.0
    """Sampling temperature of the replies (> 0: a group needs different replies)."""
    top_p: float = 1.0
    reward: str = ""
    """A Python file defining ``reward(prompt, completion, record) -> float`` (prompt and
    completion as text, record the data line as a dict); empty: the answer check below."""
    answer_regex: str = r"(?s)(.*)"
    r"""The answer check when no reward file is given: 1.0 when the regex's first group, found
    in the reply, equals the record's "answer" (both stripped), else 0.0. The default compares
    the whole reply; e.g. r"answer is (\S+)" takes the word after "answer is"."""
    kl_beta: float = 0.0
    """The weight of the KL penalty to the reference model (0: none, the GRPO of DAPO and Dr.
    GRPO; DeepSeekMath used 0.04). LoRA and QLoRA runs only: their base is the reference."""
    prompts_together: int = 4
    """At most this many prompts' group_size replies each are decoded in one batch (a decode
    step reads the weights once for all their rows); the planner takes the most whose KV caches
    fit the VRAM budget together. 1: one prompt's group at a time."""


@dataclass(frozen=True)
class BudgetConfig:
    vram: str = "auto"
    """GPU memory budget, e.g. "24GiB"; auto = the GPU's free memory less a margin."""
    ram: str = "auto"
    """Host memory budget; auto = available RAM less a margin."""
    slots: int = 0
    """Parameter slots on the GPU (K); 0 lets the planner choose."""
    checkpoints: str = "auto"
    """Activation checkpoints: auto, gpu or host."""
    gpu_layers: int = -1
    """Decoder layers kept on the GPU with their master weights and moments, updated there (the
    embedding and head too); -1 lets the planner use spare VRAM, 0 keeps all optimizer work on
    the CPU."""
    nvme_dir: str = ""
    """Folder for the NVMe tier (on disk: the optimizer state of full fine-tuning, or the frozen
    base of lora / qlora, of the layers host RAM cannot hold); empty: none."""
    nvme_size: str = "0"
    """Disk budget for the NVMe tier."""


@dataclass(frozen=True)
class OutputConfig:
    run_dir: str = "runs/run"
    """Run folder: config.toml, events.jsonl, checkpoints/, final/."""
    shard_size: str = "5GiB"
    """Largest safetensors shard of the exported model."""
    keep_best: bool = False
    """Keep the checkpoint of the lowest validation loss besides the train.keep_checkpoints
    newest, and export it as final/ instead of the last step. Needs train.eval_every and a
    validation split."""
    report_to: tuple[str, ...] = ()
    """Experiment trackers that also get the per-step metrics of events.jsonl: tensorboard,
    trackio, wandb, mlflow (each through its own library, installed separately)."""


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def _coerce(value: Any, typ, where: str):
    """Check a TOML value against a field type (ints accepted for floats)."""
    if isinstance(typ, types.UnionType):  # e.g. int | str: the first type the value has
        for option in typ.__args__:
            try:
                return _coerce(value, option, where)
            except UserError:
                pass
        names = " or ".join(getattr(t, "__name__", str(t)) for t in typ.__args__)
        raise UserError(where, f"expects a {names}, got {value!r}",
                        "fix the value's type in the config file")
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise UserError(where, f"must be a table, got {value!r}", "write it as a [table]")
        return _build(typ, value, where)
    if getattr(typ, "__origin__", None) is tuple:
        if not isinstance(value, (list, tuple)):
            raise UserError(where, f"expects a list, got {value!r}",
                            "write it as a TOML array, e.g. [\"a\", \"b\"]")
        item = typ.__args__[0]
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    ok = {str: str, int: int, float: (int, float), bool: bool}.get(typ)
    if ok is None or (isinstance(value, bool) and typ is not bool) or not isinstance(value, ok):
        raise UserError(where, f"expects a {getattr(typ, '__name__', typ)}, got {value!r}",
                        "fix the value's type in the config file")
    return float(value) if typ is float else value


def _build(cls, given: dict, where: str):
    """An instance of the dataclass ``cls`` from a dict; unknown keys are errors.

    ``where`` is "<source>: <table>", e.g. "run.toml: data.columns".
    """
    hints = get_type_hints(cls)
    known = {x.name for x in fields(cls)}
    source, _, table = where.rpartition(": ")
    for k in given:
        if k not in known:
            raise UserError(source, f"unknown key '{table}.{k}'",
                            f"valid keys of [{table}]: {', '.join(sorted(known))}")
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in given.items()})


def from_dict(data: dict, source: str = "config") -> RunConfig:
    """Build a RunConfig from nested dicts; unknown sections/keys are errors."""
    sections = {}
    for f in fields(RunConfig):
        cls = f.default_factory  # type: ignore[misc]
        given = data.get(f.name, {})
        if not isinstance(given, dict):
            raise UserError(source, f"[{f.name}] must be a table", "write it as a [section]")
        sections[f.name] = _build(cls, given, f"{source}: {f.name}")
    for k in data:
        if k not in sections:
            raise UserError(source, f"unknown section [{k}]",
                            f"valid sections: {', '.join(sections)}")
    return RunConfig(**sections)


def to_dict(cfg: RunConfig) -> dict:
    """Nested dicts and lists (the shape TOML and JSON give back)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(v):
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def load(path: Path | str) -> RunConfig:
    """Read a run TOML file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(path, "does not exist", "pass the path of a run .toml file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(path, f"is not valid TOML ({e})", "fix the syntax at that line") from None
    return from_dict(data, str(path))


def override(cfg: RunConfig, dotted: dict[str, Any]) -> RunConfig:
    """Return cfg with ``{"train.micro_batch": 4, ...}`` applied (same checks as the file)."""
    data = to_dict(cfg)
    for key, value in dotted.items():
        section, _, name = key.partition(".")
        if section not in data or not name:
            raise UserError(key, "is not a config key", "use section.key, e.g. train.micro_batch")
        data[section][name] = value
    return from_dict(data, "command line")


def dumps(cfg: RunConfig) -> str:
    """TOML text of a RunConfig (the exact format :func:`load` reads)."""
    return dumps_tables(to_dict(cfg))


def dumps_tables(tables: dict) -> str:
    """TOML text of ``{section: {key: value}}``: a whole config, or some of its keys."""
    out = []
    for section, values in tables.items():
        _table(out, f"[{section}]", section, values)
    return "\n".join(out)


def _table(out: list, header: str, name: str, values: dict) -> None:
    """Append a table: its plain keys first, then its sub-tables and arrays of tables."""
    out.append(header)
    nested = []
    for k, v in values.items():
        if isinstance(v, dict):
            nested.append((f"[{name}.{k}]", v))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            nested.extend((f"[[{name}.{k}]]", item) for item in v)
        else:
            out.append(f"{k} = {_toml_value(v)}")
    out.append("")
    for head, v in nested:
        _table(out, head, head.strip("[]"), v)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


MAX_BYTES = 1 << 60
"""The largest size :func:`parse_bytes` reads (1 EiB)."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def format_bytes(n: float) -> str:
    """A size for people, in binary units like the budgets: 1536 -> "1.5 KiB", 3e13 -> "27.3 TiB".

    The one way sizes are written in the product (CLI, plans, the desktop app).
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str, where: str = "size") -> int:
    """Parse "24GiB", "1.5 TB", "512MiB" or a plain byte count."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = None
    if value is None or unit not in _UNITS:
        raise UserError(where, f"cannot read {text!r} as a size",
                        "write a number with a unit, e.g. 24GiB, 128GB or 2TB")
    if value < 0:
        raise UserError(where, f"{text!r} is negative", "give a positive size")
    # float("1e400") is inf and int(inf) raises: anything past 1 EiB is a typo, not a budget
    if not value * _UNITS[unit] <= MAX_BYTES:
        raise UserError(where, f"{text!r} is larger than any machine's memory or disk",
                        "write a size such as 24GiB, 128GB or 2TB")
    return int(value * _UNITS[unit])
