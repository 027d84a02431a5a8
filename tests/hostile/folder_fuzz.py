"""Hostile model folders for property-based testing (hypothesis strategies).

A :class:`Breakage` says which file of a model folder it breaks and which field, and breaks a copy
of the folder. The strategies cover every field the engine reads: config.json (sizes, floats,
flags, RoPE scaling, sliding windows, dtypes), tokenizer.json, tokenizer_config.json and its
chat_template, chat_template.jinja, safetensors headers (dtype, shape, offsets, lengths, truncated
files) and ``model.safetensors.index.json`` (paths, types). :func:`load_folder` is what the engine
does with a folder before training (read the spec, plan, set up the Trainer);
:func:`check_refusal` is the property every refusal must have.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hypothesis import strategies as st

from slideformer.engine.errors import UserError

DELETE = object()
"""A field value that removes the field."""


@dataclass(frozen=True)
class Breakage:
    """One change to a model folder."""

    file: str
    """The file it changes, relative to the model folder."""
    field: str | None
    """The field it changes (a config.json or tokenizer_config.json key), or None."""
    what: str
    """What it does, for the report of a failing example."""
    change: Callable[[Path], None]

    def apply(self, folder: Path) -> bool:
        """Break ``folder``; False where an earlier breakage left nothing this one can edit (the
        file is no longer a JSON object, or no longer has a safetensors header)."""
        try:
            self.change(folder)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, struct.error):
            return False
        return True

    def __repr__(self) -> str:
        return f"{self.file}: {self.what}"


# ---- hostile JSON values ------------------------------------------------------------------------
_EDGE_INTS = [0, -1, 1, 2, 3, 7, 1023, 1024, 1025, 2**17 + 1, 2**24 + 1, 2**31, 2**63, 10**15,
              -(10**15), 10**400]
_EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e300, 1.5, -1.0, math.inf, -math.inf, math.nan]
_json_scalar = st.one_of(st.none(), st.booleans(), st.sampled_from(_EDGE_INTS),
                         st.integers(-(2**40), 2**40), st.sampled_from(_EDGE_FLOATS),
                         st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=12), st.sampled_from(["", "abc", "1", "1e9", "\ud800"]))
hostile_value = st.recursive(_json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
"""Any JSON value (NaN, infinities and lone surrogates included), small or absurd."""
_value_or_delete = st.one_of(st.just(DELETE), hostile_value)


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, allow_nan=True))


def edit_json(path: Path, changes: dict) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is DELETE:
            data.pop(k, None)
        else:
            data[k] = v
    _write_json(path, data)


# ---- config.json ---------------------------------------------------------------------------------
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                 "tie_word_embeddings", "attention_bias", "mlp_bias", "max_position_embeddings",
                 "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                 "torch_dtype", "dtype")
"""Every key of config.json the engine reads (slideformer.engine.models.spec)."""
_families = st.sampled_from(["llama", "mistral", "qwen2", "qwen3"])
_rope = st.fixed_dictionaries(
    {"rope_type": st.one_of(st.sampled_from(["linear", "llama3", "default", "yarn"]),
                            hostile_value)},
    optional={k: st.one_of(st.floats(0.5, 64), hostile_value) for k in
              ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings", "rope_theta")})
_window = st.fixed_dictionaries(
    {"sliding_window": _value_or_delete},
    optional={"model_type": _families, "use_sliding_window": _value_or_delete,
              "max_window_layers": _value_or_delete,
              "layer_types": st.one_of(hostile_value, st.lists(st.sampled_from(
                  ["full_attention", "sliding_attention", 1, None]), max_size=3))})


def config_breakage(changes: dict) -> Breakage:
    shown = {k: ("<deleted>" if v is DELETE else v) for k, v in changes.items()}
    return Breakage("config.json", ",".join(changes), f"set {shown!r}",
                    lambda d: edit_json(d / "config.json", changes))


config_breakages = st.one_of(
    st.builds(lambda k, v: config_breakage({k: v}), st.sampled_from(CONFIG_FIELDS),
              _value_or_delete),
    st.builds(lambda k, v: config_breakage({k: v}), st.sampled_from(["rope_scaling",
                                                                      "rope_parameters"]), _rope),
    _window.map(config_breakage),
    st.builds(lambda v: Breakage("config.json", None, f"the whole file is {v!r}",
                                 lambda d: _write_json(d / "config.json", v)),
              hostile_value.filter(lambda v: not isinstance(v, dict))))


# ---- tokenizer files -----------------------------------------------------------------------------
TOKENIZER_CONFIG_FIELDS = ("bos_token", "eos_token", "pad_token", "chat_template",
                           "add_bos_token", "model_max_length")
HOSTILE_TEMPLATES = ["{% for %}", "{{ messages[0]['content'] }}", "{{ raise_exception('no') }}",
                     "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                     "{% endfor %}",
                     "{{ ''.__class__.__mro__ }}", "{{ 'x' * 10**9 }}", "{{ 9 ** (10 ** 10) }}",
                     "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "plain text", ""]
_template = st.one_of(st.sampled_from(HOSTILE_TEMPLATES), st.text(max_size=40), hostile_value,
                      st.lists(st.fixed_dictionaries({"name": hostile_value,
                                                      "template": hostile_value}), max_size=2))
_token = st.one_of(hostile_value, st.sampled_from(["<|im_end|>", "<|unknown|>", ""]),
                   st.fixed_dictionaries({"content": hostile_value}))


def tokenizer_config_breakage(key: str, value) -> Breakage:
    return Breakage("tokenizer_config.json", key, f"set {key} = {value!r}"[:300],
                    lambda d: edit_json(d / "tokenizer_config.json", {key: value}))


def tokenizer_json_breakage(key: str, value) -> Breakage:
    return Breakage("tokenizer.json", key, f"set {key} = {value!r}"[:300],
                    lambda d: edit_json(d / "tokenizer.json", {key: value}))


def _added_token(d: Path, token_id, content) -> None:
    path = d / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"].append({"id": token_id, "content": content, "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})
    _write_json(path, data)


def truncated(rel: str, fraction: float) -> Breakage:
    def apply(d: Path) -> None:
        raw = (d / rel).read_bytes()
        (d / rel).write_bytes(raw[:int(len(raw) * fraction)])
    return Breakage(rel, None, f"truncated to {fraction:.0%}", apply)


def jinja_breakage(data: bytes) -> Breakage:
    def apply(d: Path) -> None:
        edit_json(d / "tokenizer_config.json", {"chat_template": DELETE})
        (d / "chat_template.jinja").write_bytes(data)
    return Breakage("chat_template.jinja", None, f"holds {data[:60]!r}", apply)


tokenizer_breakages = st.one_of(
    st.builds(tokenizer_config_breakage, st.sampled_from(TOKENIZER_CONFIG_FIELDS[:3]), _token),
    st.builds(tokenizer_config_breakage, st.just("chat_template"), _template),
    st.builds(tokenizer_config_breakage, st.sampled_from(TOKENIZER_CONFIG_FIELDS[4:]),
              hostile_value),
    st.builds(lambda v: Breakage("tokenizer_config.json", None, f"the whole file is {v!r}",
                                 lambda d: _write_json(d / "tokenizer_config.json", v)),
              hostile_value),
    st.builds(tokenizer_json_breakage, st.sampled_from(
        ["added_tokens", "model", "normalizer", "pre_tokenizer", "post_processor", "decoder",
         "truncation", "padding", "version"]), hostile_value),
    st.builds(lambda i, c: Breakage("tokenizer.json", "added_tokens", f"adds token id {i!r}",
                                    lambda d: _added_token(d, i, c)),
              st.one_of(st.sampled_from([-1, 383, 384, 10**6, 2**32, 2**64]), hostile_value),
              st.one_of(st.just("<|extra|>"), hostile_value)),
    st.builds(lambda v: Breakage("tokenizer.json", None, f"the whole file is {v!r}",
                                 lambda d: _write_json(d / "tokenizer.json", v)), hostile_value),
    st.builds(truncated, st.just("tokenizer.json"), st.floats(0, 0.99)),
    st.builds(jinja_breakage, st.one_of(st.binary(max_size=40),
                                         st.sampled_from(HOSTILE_TEMPLATES).map(str.encode))))


# ---- safetensors -------------------------------------------------------------------------------
def _rewrite_header(d: Path, change: Callable[[dict], None]) -> None:
    path = d / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    data = json.dumps(header, allow_nan=True).encode("utf-8", "surrogatepass")
    data += b" " * (-len(data) % 8)
    path.write_bytes(struct.pack("<Q", len(data)) + data + raw[8 + n:])


def tensor_breakage(index: int, key: str, value) -> Breakage:
    def change(header: dict) -> None:
        names = sorted(k for k in header if k != "__metadata__")
        entry = header[names[index % len(names)]]
        if value is DELETE:
            entry.pop(key, None)
        else:
            entry[key] = value
    return Breakage("model.safetensors", key, f"tensor #{index}: {key} = {value!r}"[:300],
                    lambda d: _rewrite_header(d, change))


def header_breakage(key: str, value) -> Breakage:
    def change(header: dict) -> None:
        header[key] = value
    return Breakage("model.safetensors", key, f"header {key!r} = {value!r}"[:300],
                    lambda d: _rewrite_header(d, change))


def length_breakage(n: int) -> Breakage:
    def apply(d: Path) -> None:
        path = d / "model.safetensors"
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", n) + raw[8:])
    return Breakage("model.safetensors", None, f"header length {n}", apply)


_shape = st.one_of(hostile_value, st.lists(st.one_of(st.integers(-2, 400),
                                                     st.sampled_from([2**32, 2**62])), max_size=3))
_offsets = st.one_of(hostile_value, st.lists(st.one_of(st.integers(-8, 200_000),
                                                       st.sampled_from([2**63, 2**64])),
                                             min_size=0, max_size=3))
_dtype = st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "I64",
                                    "F8_E4M3", "F8_E5M2", "F4", "bogus", ""]), hostile_value)
safetensors_breakages = st.one_of(
    st.builds(tensor_breakage, st.integers(0, 20), st.just("shape"), _shape),
    st.builds(tensor_breakage, st.integers(0, 20), st.just("data_offsets"), _offsets),
    st.builds(tensor_breakage, st.integers(0, 20), st.just("dtype"), _dtype),
    st.builds(tensor_breakage, st.integers(0, 20), st.sampled_from(["shape", "dtype",
                                                                     "data_offsets"]),
              st.just(DELETE)),
    st.builds(header_breakage, st.sampled_from(["__metadata__", "model.embed_tokens.weight",
                                                 "extra.weight"]), hostile_value),
    st.builds(length_breakage, st.one_of(st.integers(0, 200_000),
                                          st.sampled_from([2**63, 2**64 - 1]))),
    st.builds(truncated, st.just("model.safetensors"), st.floats(0, 0.999)))


# ---- model.safetensors.index.json ------------------------------------------------------------
INDEX = "model.safetensors.index.json"
_shard_name = st.one_of(
    st.sampled_from(["model.safetensors", "../model.safetensors", "/etc/passwd",
                     "C:\\x.safetensors", "sub/../model.safetensors", "missing.safetensors",
                     "", ".", "..", "a" * 300, "nul\x00.safetensors", "\ud800.safetensors",
                     "config.json", "tokenizer.json"]),
    st.text(max_size=20), hostile_value)


def index_breakage(weight_map, extra) -> Breakage:
    def apply(d: Path) -> None:
        _write_json(d / INDEX, {"metadata": extra, "weight_map": weight_map})
    return Breakage(INDEX, "weight_map", f"weight_map {weight_map!r}"[:300], apply)


index_breakages = st.one_of(
    st.builds(index_breakage, st.one_of(
        hostile_value, st.dictionaries(st.sampled_from(["model.embed_tokens.weight",
                                                        "lm_head.weight", "x"]),
                                       _shard_name, max_size=3)),
              hostile_value),
    st.builds(lambda v: Breakage(INDEX, None, f"the whole file is {v!r}",
                                 lambda d: _write_json(d / INDEX, v)), hostile_value))

breakages = st.lists(st.one_of(config_breakages, tokenizer_breakages, safetensors_breakages,
                               index_breakages), min_size=1, max_size=2)
"""One or two breakages of one model folder."""


def check_refusal(e: UserError, broken: list[Breakage]) -> None:
    """A refusal names a file that was broken (a tensor's shape naming config.json counts); one
    about config.json names a field that was changed (unless the whole file was replaced)."""
    text = str(e)
    assert any(b.file in text for b in broken), f"{text!r} names none of {broken}"
    changes = [b for b in broken if b.file == "config.json"]
    fields = [f for b in changes if b.field for f in b.field.split(",")]
    if Path(e.where).name == "config.json" and fields and all(b.field for b in changes):
        assert any(f in text for f in fields), f"{text!r} names none of the fields {fields}"
