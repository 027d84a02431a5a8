"""The hostile-input corpus: inputs that once gave a traceback, hung, were silently accepted or
blamed the wrong setting, each with the words its one message must contain.

Every case runs ``slideformer`` (``slideformer.engine.cli``) in a copy of a work folder that holds a tiny
model (``model/``), chat data (``train.jsonl``) and a run config (``run.toml``). The test modules
``test_hostile_<category>.py`` run their category in-process; ``test_hostile_corpus.py`` runs the
whole corpus with a process per case (corpus_processes.py) and a timeout.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slideformer.engine import config as config_mod
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.train.demo import write_task

TIMEOUT = 60
"""Seconds a subprocess case may take before it counts as a hang."""
TINY = TinyShape(layers=2, hidden=32, heads=2, kv_heads=1, intermediate=48)
"""The shape of the work folder's model."""


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    words: tuple[str, ...]
    """Words the message must contain (the file or key at fault, the problem)."""
    prepare: Callable[[Path], None] | None = None
    code: int = 2
    """Expected exit code: 2 for a refused input; 0 for a documented success."""
    env: dict = field(default_factory=dict)
    """Environment variables; ``{w}`` in a value is the work folder."""


def make_workspace(root: Path) -> Path:
    """The work folder every case starts from (copied per case)."""
    make_tiny_model(root / "model", "llama", TINY, seed=5)
    write_task(root / "train.jsonl", 40, 1)
    cfg = config_mod.from_dict({
        "model": {"path": "model"}, "data": {"train": "train.jsonl", "max_seq_len": 32},
        "train": {"micro_batch": 2, "max_steps": 2, "device": "cpu"},
        "budget": {"slots": 2}, "output": {"run_dir": "run"}})
    (root / "run.toml").write_text(config_mod.dumps(cfg))
    profile(file="reference.json")(root)  # plans that do not depend on this machine
    return root


# ---- helpers for preparing a case --------------------------------------------------------------
def train(*args: str) -> tuple[str, ...]:
    return ("train", "--config", "run.toml", *args)


def plan(*args: str) -> tuple[str, ...]:
    return ("plan", "--model", "model", "--hardware", "reference.json", *args)


def setkey(key: str, toml_value: str) -> tuple[str, ...]:
    return train("--set", f"{key}={toml_value}")


def edit_json(rel: str, **changes) -> Callable[[Path], None]:
    def prepare(w: Path) -> None:
        path = w / rel
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))
    return prepare


def write(rel: str, data: str | bytes) -> Callable[[Path], None]:
    def prepare(w: Path) -> None:
        path = w / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
    return prepare


def data_line(line: str, rel: str = "train.jsonl") -> Callable[[Path], None]:
    """Append one raw JSON line to the data (after 40 good records: the message names line 41)."""
    def prepare(w: Path) -> None:
        with open(w / rel, "ab") as f:
            f.write(line.encode("utf-8", "surrogatepass") + b"\n")
    return prepare


def chat_template(template) -> Callable[[Path], None]:
    return edit_json("model/tokenizer_config.json", chat_template=template)


def safetensors_dtype(dtype: str) -> Callable[[Path], None]:
    """Rewrite the header of model.safetensors so every tensor claims ``dtype`` (same bytes)."""
    def prepare(w: Path) -> None:
        path = w / "model" / "model.safetensors"
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        body = raw[8 + n:]
        out, pos = {}, 0
        for name, info in sorted((k, v) for k, v in header.items() if k != "__metadata__"):
            a, b = info["data_offsets"]
            count = 1
            for d in info["shape"]:
                count *= d
            out[name] = {"dtype": dtype, "shape": info["shape"], "data_offsets": [pos, pos + count]}
            pos += count
        data = json.dumps(out).encode()
        path.write_bytes(struct.pack("<Q", len(data)) + data + body[:pos])
    return prepare


def nan_weight(w: Path) -> None:
    """Put a NaN into one tensor of the model (written with safetensors, a valid file)."""
    from safetensors.torch import load_file, save_file
    path = w / "model" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})


def index_naming(target: str) -> Callable[[Path], None]:
    def prepare(w: Path) -> None:
        from safetensors import safe_open
        with safe_open(str(w / "model" / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        wm = {n: "model.safetensors" for n in names}
        wm[names[0]] = target
        (w / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return prepare


def extra_token(w: Path) -> None:
    """A tokenizer that can produce an id the model's embedding does not have."""
    path = w / "model" / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = json.loads((w / "model" / "config.json").read_text())["vocab_size"]
    tok["added_tokens"].append({"id": vocab + 5, "content": "<|extra|>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    path.write_text(json.dumps(tok))


def profile(file: str = "hw.json", **values) -> Callable[[Path], None]:
    """A hardware profile file: the reference machine's, with ``values`` changed."""
    def prepare(w: Path) -> None:
        from slideformer.engine.plan.hardware import REFERENCE
        d = REFERENCE.to_dict()
        d.update(values)
        (w / file).write_text(json.dumps(d))
    return prepare


NESTED = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 100_000
CFG = "model/config.json"

# ---- the corpus, by category --------------------------------------------------------------------
TRACEBACKS = [
    Case("ram budget 1e400GiB", setkey("budget.ram", '"1e400GiB"'), ("budget.ram", "1e400GiB")),
    Case("vram budget 1e400GiB in plan", plan("--vram", "1e400GiB"), ("budget.vram",)),
    Case("shard size 1e400TB", setkey("output.shard_size", '"1e400TB"'), ("output.shard_size",)),
    Case("nvme size 1e400GiB", setkey("budget.nvme_size", '"1e400GiB"'), ("budget.nvme_size",)),
    Case("ram budget inf", setkey("budget.ram", '"inf"'), ("budget.ram",)),
    Case("ram budget nan", plan("--ram", "nanGiB"), ("budget.ram",)),
    Case("epochs inf", train("--max-steps", "0", "--set", "train.epochs=inf"), ("train.epochs",)),
    Case("epochs nan", train("--max-steps", "0", "--set", "train.epochs=nan"), ("train.epochs",)),
    Case("epochs -inf", train("--max-steps", "0", "--set", "train.epochs=-inf"),
         ("train.epochs",)),
    Case("lr inf", setkey("optim.lr", "inf"), ("optim.lr",)),
    Case("eps nan", setkey("optim.eps", "nan"), ("optim.eps",)),
    Case("data seed negative", setkey("data.seed", "-1"), ("data.seed",)),
    Case("train seed 2**70", setkey("train.seed", str(2**70)), ("train.seed",)),
    Case("val_fraction nan", setkey("data.val_fraction", "nan"), ("data.val_fraction",)),
    Case("max_position_embeddings 'abc'", train(), ("config.json", "max_position_embeddings"),
         edit_json(CFG, max_position_embeddings="abc")),
    Case("max_position_embeddings 'abc' in plan", plan(), ("max_position_embeddings",),
         edit_json(CFG, max_position_embeddings="abc")),
    Case("rope_theta [1]", train(), ("config.json", "rope_theta"), edit_json(CFG, rope_theta=[1])),
    Case("rope_theta 0", plan(), ("rope_theta",), edit_json(CFG, rope_theta=0)),
    Case("rope_theta NaN", plan(), ("rope_theta",), edit_json(CFG, rope_theta=float("nan"))),
    Case("rms_norm_eps 'tiny'", train(), ("config.json", "rms_norm_eps"),
         edit_json(CFG, rms_norm_eps="tiny")),
    Case("rms_norm_eps negative", plan(), ("rms_norm_eps",), edit_json(CFG, rms_norm_eps=-1e-6)),
    Case("num_key_value_heads '1'", plan(), ("num_key_value_heads",),
         edit_json(CFG, num_key_value_heads="1")),
    Case("head_dim 2.5", plan(), ("head_dim",), edit_json(CFG, head_dim=2.5)),
    Case("hidden_size true", plan(), ("hidden_size",), edit_json(CFG, hidden_size=True)),
    Case("model_type a list", plan(), ("model_type",), edit_json(CFG, model_type=["llama"])),
    Case("torch_dtype a number", plan(), ("torch_dtype",), edit_json(CFG, torch_dtype=5)),
    Case("rope_scaling a string", plan(), ("rope_scaling",), edit_json(CFG, rope_scaling="linear")),
    Case("rope_scaling factor a string", plan(), ("rope_scaling",),
         edit_json(CFG, rope_scaling={"type": "linear", "factor": "2"})),
    Case("rope_scaling factor 0", plan(), ("rope_scaling",),
         edit_json(CFG, rope_scaling={"type": "linear", "factor": 0})),
    Case("rope_parameters a list", plan(), ("rope_parameters",),
         edit_json(CFG, rope_parameters=[1, 2])),
    Case("config.json deeply nested", plan(), ("config.json",), write(CFG, NESTED)),
    Case("config.json huge integer", plan(), ("config.json",),
         write(CFG, '{"model_type": "llama", "hidden_size": ' + HUGE_INT + "}")),
    Case("config.json lone surrogate", plan(), ("config.json",),
         edit_json(CFG, model_type="llama\ud800")),
    Case("layer count 10**15 in plan", plan(), ("num_hidden_layers",),
         edit_json(CFG, num_hidden_layers=10**15)),
    Case("layer count 10**15 in train", train(), ("num_hidden_layers",),
         edit_json(CFG, num_hidden_layers=10**15)),
    Case("vocab_size 10**15", plan(), ("vocab_size",), edit_json(CFG, vocab_size=10**15)),
    Case("hidden_size 10**12", plan(), ("hidden_size",), edit_json(CFG, hidden_size=10**12,
                                                                     head_dim=16)),
    Case("tokenizer_config.json a list", train(), ("tokenizer_config.json",),
         write("model/tokenizer_config.json", "[1, 2]")),
    Case("tokenizer_config.json a string", train(), ("tokenizer_config.json",),
         write("model/tokenizer_config.json", '"hello"')),
    Case("tokenizer_config.json deeply nested", train(), ("tokenizer_config.json",),
         write("model/tokenizer_config.json", NESTED)),
    Case("tokenizer_config.json not UTF-8", train(), ("tokenizer_config.json",),
         write("model/tokenizer_config.json", b'{"eos_token": "\xff"}')),
    Case("chat_template a number", train(), ("chat_template",), chat_template(42)),
    Case("chat_template a dict", train(), ("chat_template",), chat_template({"a": 1})),
    Case("chat_template list of strings", train(), ("chat_template",), chat_template(["x", "y"])),
    Case("chat_template list without a template", train(), ("chat_template",),
         chat_template([{"name": "default"}])),
    Case("chat_template.jinja not UTF-8", train(), ("chat_template.jinja",),
         lambda w: (chat_template(None)(w), write("model/chat_template.jinja", b"\xff{{ x }}")(w))),
    Case("data record deeply nested", train(), ("train.jsonl:41",),
         data_line('{"messages": ' + "[" * 50_000 + "]" * 50_000 + "}")),
    Case("data record huge integer", train(), ("train.jsonl:41",),
         data_line('{"text": "a", "n": ' + HUGE_INT + "}")),
    Case("data record lone surrogate", train(), ("train.jsonl:41", "surrogate"),
         data_line('{"messages": [{"role": "user", "content": "hi \\ud800"}, '
                   '{"role": "assistant", "content": "ok"}]}')),
    Case("data .json array deeply nested", train("--data", "arr.json"), ("arr.json",),
         write("arr.json", "[" + '{"text": ' + "[" * 50_000 + "]" * 50_000 + "}]")),
    Case("data .txt lone surrogate escape in text", train("--data", "t.txt"), ("t.txt",),
         write("t.txt", b"hello \xed\xa0\x80 there\n")),
    Case("data file name not UTF-8", train("--data", os.fsdecode(b"d\xff.jsonl")),
         ("data.train", "UTF-8")),
    Case("text folder holding a file name not UTF-8", train("--data", "texts"), ("model saved",),
         lambda w: (write("texts/a.txt", "Some words to train on.\n\n" * 200)(w),
                    write(os.fsdecode(b"texts/b\xff.txt"), "More words here.\n\n" * 200)(w)),
         code=0),
    Case("run folder name not UTF-8", train("--run-dir", os.fsdecode(b"r\xfe")),
         ("output.run_dir", "UTF-8")),
    Case("model folder name not UTF-8", train("--model", os.fsdecode(b"m\xff")),
         ("model.path", "UTF-8")),
    Case("run folder's parent is a file", train("--run-dir", "afile/run"), ("afile",),
         write("afile", "x")),
    Case("token cache is a file", train(), (".token-cache", "is a file"), write(".token-cache", "x")),
    Case("checkpoints is a file", train(), ("checkpoints",), write("run/checkpoints", "x")),
    Case("hardware cache folder is a file", ("bench", "--hardware"), ("slideformer",),
         write("cache/slideformer", "x"), env={"XDG_CACHE_HOME": "{w}/cache"}),
    Case("hardware profile all zeros", ("plan", "--model", "model", "--hardware", "hw.json"),
         ("hw.json",),
         profile(matmul_tflops=0, cpu_tflops=0, h2d_gbs=0, d2h_gbs=0, duplex_gbs=0,
                 adam_params_per_s=0, disk_read_gbs=0, disk_write_gbs=0, cpu_cores=0)),
    Case("hardware profile negative bandwidth", ("plan", "--model", "model", "--hardware",
                                                  "hw.json"), ("hw.json", "h2d_gbs"),
         profile(h2d_gbs=-5)),
    Case("hardware profile string figure", ("plan", "--model", "model", "--hardware", "hw.json"),
         ("hw.json", "matmul_tflops"), profile(matmul_tflops="fast")),
    Case("hardware profile NaN figure", ("plan", "--model", "model", "--hardware", "hw.json"),
         ("hw.json", "adam_params_per_s"), profile(adam_params_per_s=float("nan"))),
    Case("hardware profile a list", ("plan", "--model", "model", "--hardware", "hw.json"),
         ("hw.json",), write("hw.json", "[1]")),
    Case("hardware profile missing a field", ("plan", "--model", "model", "--hardware", "hw.json"),
         ("hw.json",), write("hw.json", '{"name": "x"}')),
]

SILENT = [
    Case("lr negative", setkey("optim.lr", "-1e-5"), ("optim.lr",)),
    Case("lr zero", setkey("optim.lr", "0"), ("optim.lr",)),
    Case("lr 1000", setkey("optim.lr", "1000.0"), ("optim.lr",)),
    Case("beta1 1.5", setkey("optim.beta1", "1.5"), ("optim.beta1",)),
    Case("beta2 1", setkey("optim.beta2", "1.0"), ("optim.beta2",)),
    Case("beta1 negative", setkey("optim.beta1", "-0.1"), ("optim.beta1",)),
    Case("eps zero", setkey("optim.eps", "0"), ("optim.eps",)),
    Case("weight decay negative", setkey("optim.weight_decay", "-0.1"), ("optim.weight_decay",)),
    Case("max_grad_norm negative", setkey("optim.max_grad_norm", "-1.0"),
         ("optim.max_grad_norm",)),
    Case("warmup negative", setkey("optim.warmup_steps", "-5"), ("optim.warmup_steps",)),
    Case("min_lr_ratio 2", setkey("optim.min_lr_ratio", "2.0"), ("optim.min_lr_ratio",)),
    Case("eval_every negative", setkey("train.eval_every", "-1"), ("train.eval_every",)),
    Case("gpu_layers -2", setkey("budget.gpu_layers", "-2"), ("budget.gpu_layers",)),
    Case("max_steps negative", train("--max-steps", "-3"), ("train.max_steps",)),
    Case("int8 weights", train(), ("model.safetensors", "I8"), safetensors_dtype("I8")),
    Case("uint8 weights", train(), ("model.safetensors", "U8"), safetensors_dtype("U8")),
    Case("bool weights", train(), ("model.safetensors", "BOOL"), safetensors_dtype("BOOL")),
    Case("head count makes head_dim 0 in plan", plan(), ("head_dim",),
         edit_json(CFG, num_attention_heads=64, num_key_value_heads=64)),
    Case("head count makes head_dim 0 in train", train(), ("head_dim",),
         edit_json(CFG, num_attention_heads=64, num_key_value_heads=64)),
    Case("head_dim 0", plan(), ("head_dim",), edit_json(CFG, head_dim=0)),
    Case("tie_word_embeddings 'no'", plan(), ("tie_word_embeddings",),
         edit_json(CFG, tie_word_embeddings="no")),
    Case("attention_bias 'false'", plan(), ("attention_bias",),
         edit_json(CFG, attention_bias="false")),
    Case("tokenizer ids beyond vocab_size", train(), ("tokenizer.json", "vocab_size"),
         extra_token),
    Case("run_dir empty", setkey("output.run_dir", '""'), ("output.run_dir",)),
]

HANGS = [
    Case("micro-batch 10**8 in train", train("--micro-batch", str(10**8)), ("train.micro_batch",)),
    Case("micro-batch 10**8 in plan", plan("--micro-batch", str(10**8)), ("train.micro_batch",)),
    Case("grad_accum 10**8 in plan", plan("--grad-accum", str(10**8)), ("train.grad_accum",)),
    Case("slots 10**9", plan("--slots", str(10**9)), ("budget.slots",)),
    Case("max_steps 10**15", train("--max-steps", str(10**15)), ("train.max_steps",)),
    Case("largest allowed micro-batch tokens in plan",
         plan("--micro-batch", "16", "--seq-len", "1048576"), ("speed:",), code=0),
    Case("micro-batch tokens above the limit in plan",
         plan("--micro-batch", "65536", "--seq-len", "1048576"), ("train.micro_batch",)),
    Case("largest allowed grad_accum in plan", plan("--grad-accum", "65536"), ("speed:",), code=0),
    Case("largest allowed layer count in plan", plan(), ("speed:",),
         edit_json(CFG, num_hidden_layers=1024), code=0),
    Case("layer count above the limit", plan(), ("num_hidden_layers", "1,024"),
         edit_json(CFG, num_hidden_layers=1025)),
]

MISLEADING = [
    Case("max_seq_len 10**9 in train", train("--seq-len", str(10**9)), ("data.max_seq_len",)),
    Case("max_seq_len 10**9 in plan", plan("--seq-len", str(10**9)), ("data.max_seq_len",)),
    Case("lr nan", setkey("optim.lr", "nan"), ("optim.lr", "nan")),
    Case("max_grad_norm nan", setkey("optim.max_grad_norm", "nan"), ("optim.max_grad_norm",)),
    Case("NaN in the weights", train(), ("model.safetensors", "model.layers.1.mlp.up_proj.weight",
                                        "NaN"), nan_weight),
]

BOUNDARIES = [
    Case("index names a .. path", train(), ("model.safetensors.index.json", "../"),
         index_naming("../outside.safetensors")),
    Case("index names an absolute path", train(), ("model.safetensors.index.json", "/"),
         index_naming("/etc/passwd")),
    Case("index names a subfolder path", train(), ("model.safetensors.index.json",),
         index_naming("sub/../../x.safetensors")),
    Case("index weight_map of numbers", train(), ("model.safetensors.index.json",),
         write("model/model.safetensors.index.json", '{"weight_map": {"a": 1}}')),
    Case("index a list", train(), ("model.safetensors.index.json",),
         write("model/model.safetensors.index.json", "[]")),
    Case("index deeply nested", train(), ("model.safetensors.index.json",),
         write("model/model.safetensors.index.json", NESTED)),
    Case("seq_len above the limit", train("--seq-len", str(2**20 + 1)), ("data.max_seq_len",)),
    Case("micro-batch above the limit", train("--micro-batch", str(2**16 + 1)),
         ("train.micro_batch",)),
    Case("device cuda:99999", train("--device", "cuda:99999"), ("train.device",)),
    Case("shard size 2EiB", setkey("output.shard_size", '"2048PiB"'), ("output.shard_size",)),
]

_NESTED_LOOPS = ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                 "{% endfor %}")
TEMPLATES = [
    Case("nested range(99999) loops", train(), ("chat_template", "budget"),
         chat_template(_NESTED_LOOPS)),
    Case("nested loops over a long string", train(), ("chat_template", "budget"),
         chat_template("{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}{% endfor %}"
                       "{% endfor %}")),
    Case("400 MB string by % formatting", train(), ("chat_template",),
         chat_template("{{ '%400000000s' % 'x' }}")),
    Case("400 MB string by format()", train(), ("chat_template",),
         chat_template("{{ '{:>400000000}'.format('x') }}")),
    Case("400 MB string by the center filter", train(), ("chat_template",),
         chat_template("{{ 'x'|center(400000000) }}")),
    Case("string doubled in a loop", train(), ("chat_template",),
         chat_template("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}")),
    Case("string doubled with + in a loop", train(), ("chat_template",),
         chat_template("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}")),
    Case("replace amplification", train(), ("chat_template",),
         chat_template("{{ ('x' * 100000).replace('x', 'y' * 100000) }}")),
    Case("replace filter amplification", train(), ("chat_template",),
         chat_template("{{ ('x' * 100000)|replace('x', 'y' * 100000) }}")),
    Case("huge output by printing in a loop", train(), ("chat_template",),
         chat_template("{% for i in range(99999) %}{{ 'x' * 999999 }}{% endfor %}")),
    Case("recursive macro", train(), ("chat_template", "recursion"),
         chat_template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")),
    Case("integer power", train(), ("chat_template",), chat_template("{{ 9 ** (10 ** 10) }}")),
    Case("attribute escape", train(), ("chat_template", "sandbox"),
         chat_template("{{ ''.__class__.__mro__ }}")),
    Case("raise_exception", train(), ("chat_template", "nope"),
         chat_template("{{ raise_exception('nope') }}")),
    Case("template syntax error", train(), ("chat_template",), chat_template("{% for %}")),
]

def pairs_file(*records, rel: str = "pairs.jsonl", good: dict | None = None
               ) -> Callable[[Path], None]:
    """A preference file: one good record (a DPO pair, or ``good``), then ``records`` (dicts, or
    raw lines as str): the message names line 2 onwards."""
    good = good or {"prompt": "x =", "chosen": " X", "rejected": " y"}

    def prepare(w: Path) -> None:
        lines = [json.dumps(good)] + [r if isinstance(r, str) else json.dumps(r) for r in records]
        (w / rel).write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    return prepare


def dpo(*args: str) -> tuple[str, ...]:
    return train("--objective", "dpo", "--data", "pairs.jsonl", *args)


def kto(*args: str) -> tuple[str, ...]:
    return train("--objective", "kto", "--data", "pairs.jsonl", *args)


KTO_GOOD = {"prompt": "x =", "completion": " X", "label": True}
PREFERENCE = [
    Case("a pair without its rejected reply", dpo(), ("pairs.jsonl:2", "'rejected'"),
         pairs_file({"prompt": "a", "chosen": "b"})),
    Case("chosen equal to rejected", dpo(), ("pairs.jsonl:2", "the same text"),
         pairs_file({"prompt": "a", "chosen": "b", "rejected": "b"})),
    Case("a reply that is a number", dpo(), ("pairs.jsonl:2", "chosen"),
         pairs_file({"prompt": "a", "chosen": 7, "rejected": "b"})),
    Case("a prompt that is null", dpo(), ("pairs.jsonl:2", "prompt"),
         pairs_file({"prompt": None, "chosen": "a", "rejected": "b"})),
    Case("a string reply beside a message list", dpo(), ("pairs.jsonl:2", "mixes"),
         pairs_file({"prompt": "a", "chosen": "b",
                     "rejected": [{"role": "assistant", "content": "c"}]})),
    Case("a conversational reply from the user", dpo(), ("pairs.jsonl:2", "assistant"),
         pairs_file({"prompt": [{"role": "user", "content": "a"}],
                     "chosen": [{"role": "user", "content": "b"}],
                     "rejected": [{"role": "assistant", "content": "c"}]})),
    Case("a message without content", dpo(), ("pairs.jsonl:2",),
         pairs_file({"prompt": [{"role": "user"}],
                     "chosen": [{"role": "assistant", "content": "b"}],
                     "rejected": [{"role": "assistant", "content": "c"}]})),
    Case("a prompt longer than the sequence limit", dpo(), ("pairs.jsonl:2", "no room"),
         pairs_file({"prompt": "a " * 60, "chosen": "b", "rejected": "c"})),
    Case("a pair record that is a list", dpo(), ("pairs.jsonl:2",),
         pairs_file('["x =", " X", " y"]')),
    Case("a pair line that is not JSON", dpo(), ("pairs.jsonl:2",), pairs_file("{chosen: 1")),
    Case("a reply of lone surrogates", dpo(), ("pairs.jsonl:2",),
         pairs_file('{"prompt": "a", "chosen": "\\ud800", "rejected": "b"}')),
    Case("SFT records under DPO", dpo(), ("pairs.jsonl", "rejected"),
         pairs_file(good={"messages": [{"role": "user", "content": "a"},
                                       {"role": "assistant", "content": "b"}]})),
    Case("KTO label that is a string", kto(), ("pairs.jsonl:2", "true or false"),
         pairs_file({"prompt": "a", "completion": "b", "label": "yes"}, good=KTO_GOOD)),
    Case("KTO label that is 1", kto(), ("pairs.jsonl:2", "true or false"),
         pairs_file({"prompt": "a", "completion": "b", "label": 1}, good=KTO_GOOD)),
    Case("KTO record without a completion", kto(), ("pairs.jsonl:2", "'completion'"),
         pairs_file({"prompt": "a", "label": True}, good=KTO_GOOD)),
    Case("a DPO pair under KTO", kto(), ("pairs.jsonl:2", "pair"),
         pairs_file({"prompt": "a", "chosen": "b", "rejected": "c"}, good=KTO_GOOD)),
    Case("preference pairs under SFT", train("--data", "pairs.jsonl"),
         ("pairs.jsonl:1", "--objective"), pairs_file()),
    Case("beta of zero", dpo("--set", "preference.beta=0.0"), ("preference.beta",), pairs_file()),
    Case("a loss type misspelt", dpo("--set", "preference.loss=\"sigmod\""), ("preference.loss",),
         pairs_file()),
]

CATEGORIES = {"tracebacks": TRACEBACKS, "silent": SILENT, "hangs": HANGS,
              "misleading": MISLEADING, "boundaries": BOUNDARIES, "templates": TEMPLATES,
              "preference": PREFERENCE}


# ---- running a case ---------------------------------------------------------------------------
def prepare_case(case: Case, pristine: Path, w: Path) -> dict:
    """Copy the work folder to ``w`` and break it; returns the environment changes."""
    shutil.copytree(pristine, w, symlinks=True)
    if case.prepare is not None:
        case.prepare(w)
    return {k: v.replace("{w}", str(w)) for k, v in case.env.items()}


def check_outcome(case: Case, code: int, out: str, err: str) -> None:
    """The case's exit code; a refused input: one error line on stderr with its words."""
    assert "Traceback" not in err, err[-3000:]
    assert "[Errno" not in out + err, (out + err)[-2000:]  # an OSError's text, not a message
    assert code == case.code, f"exit {code}, expected {case.code}: {err[-2000:]}"
    text = err if case.code else out + err
    if case.code:
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1, err[-2000:]
        assert "fix:" in err, err
    for word in case.words:
        assert word in text, f"{word!r} not in: {text[-2000:]}"


def run_in_process(case: Case, pristine: Path, tmp: Path, capsys, monkeypatch) -> None:
    """Run ``slideformer.engine.cli.main`` on a case in this process and check its outcome."""
    from slideformer.engine.cli import main
    w = tmp / "w"
    for k, v in prepare_case(case, pristine, w).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(w)
    try:
        code = main(list(case.args))
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    check_outcome(case, code, out, err)


def params(cases: list[Case]) -> list:
    """pytest parameters: a case that trains to the end (a documented success) is slow."""
    import pytest
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.code == 0 else [])
            for c in cases]
