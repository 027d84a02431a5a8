"""Hostile GGUF files for property-based testing (hypothesis strategies).

A valid GGUF file (the tiny model, exported) is taken apart by :func:`parse`, a reader written
here from the format's description and independent of the engine's: magic, version, the two
counts, the key-values, the tensor infos, the data. A :class:`Mutation` changes the parts (or
the bytes :func:`encode` makes of them) the way a hostile or broken file would: cut short at a
structural boundary, a wrong magic or version, counts, offsets, shapes, types and length fields
that lie, duplicate keys, metadata of the wrong type, tokenizer arrays of the wrong length,
hostile chat templates, NaN weights. Each mutation says whether the engine must refuse the
result (``must_refuse``: the file lies about itself) or may take it (a value it is free to
accept). :func:`check_gguf` is the property: what discovery and import do with the file.
"""
from __future__ import annotations

import copy
import math
import resource
import signal
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from hypothesis import strategies as st

from slideformer.engine.errors import UserError

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "<B", I8: "<B", U16: "<H", I16: "<H", U32: "<I", I32: "<I", F32: "<f",
            BOOL: "<B", U64: "<Q", I64: "<Q", F64: "<d"}
"""Value type -> how this writer packs it (integers wrap, so -1 is written as all ones)."""
INTEGERS = (U8, I8, U16, I16, U32, I32, U64, I64)


# ---- a GGUF file taken apart --------------------------------------------------------------------
@dataclass
class Value:
    """A typed metadata value: a scalar, a str, or for ARRAY ``(element type, [values])``."""
    vtype: int
    value: object
    raw: bytes | None = None
    """The encoded bytes, written instead of ``value`` (a length field that lies)."""


@dataclass
class KV:
    key: str
    value: Value
    key_length: int | None = None
    """The key's length field as written; None: the true one."""


@dataclass
class Tensor:
    name: str
    dims: list[int]
    ttype: int
    offset: int
    n_dims: int | None = None
    """The dimension count as written; None: ``len(dims)``."""


@dataclass
class GGUFParts:
    magic: bytes
    version: int
    kvs: list[KV]
    tensors: list[Tensor]
    data: bytes
    """The data section (from its aligned start to the end of the file)."""
    pad_to: int = 32
    """The alignment this writer pads the tensor table to (the file's own)."""
    n_tensors: int | None = None
    n_kv: int | None = None
    """Counts as written; None: the true ones."""

    def kv(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def value(self, key: str, default=None):
        kv = self.kv(key)
        return default if kv is None else kv.value.value


def parse(raw: bytes) -> GGUFParts:
    """A valid GGUF v3 file taken apart (the seeds are files the engine exported)."""
    at = 0

    def take(fmt):
        nonlocal at
        (v,) = struct.unpack_from(fmt, raw, at)
        at += struct.calcsize(fmt)
        return v

    def string():
        nonlocal at
        n = take("<Q")
        at += n
        return raw[at - n:at].decode()

    def value(vtype):
        if vtype == STRING:
            return string()
        if vtype == ARRAY:
            etype, n = take("<I"), take("<Q")
            return etype, [value(etype) for _ in range(n)]
        fmt = {I8: "<b", I16: "<h", I32: "<i", I64: "<q", BOOL: "<?"}.get(vtype, _FORMATS[vtype])
        return take(fmt)

    magic, version = raw[:4], struct.unpack_from("<I", raw, 4)[0]
    at = 8
    n_tensors, n_kv = take("<Q"), take("<Q")
    kvs = []
    for _ in range(n_kv):
        key = string()
        vtype = take("<I")
        kvs.append(KV(key, Value(vtype, value(vtype))))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        tensors.append(Tensor(name, dims, take("<I"), take("<Q")))
    align = next((kv.value.value for kv in kvs if kv.key == "general.alignment"), 32)
    start = -(-at // align) * align
    return GGUFParts(magic, version, kvs, tensors, raw[start:], pad_to=align)


def _encode_value(v: Value) -> bytes:
    if v.raw is not None:
        return v.raw
    if v.vtype == STRING:
        data = v.value if isinstance(v.value, bytes) else v.value.encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(data)) + data
    if v.vtype == ARRAY:
        etype, items = v.value
        return struct.pack("<IQ", etype, len(items)) + b"".join(
            _encode_value(Value(etype, x)) for x in items)
    fmt = _FORMATS[v.vtype]
    if v.vtype in (F32, F64):
        return struct.pack(fmt, v.value)
    return struct.pack(fmt, int(v.value) % (1 << 8 * struct.calcsize(fmt)))


def encode(parts: GGUFParts) -> tuple[bytes, dict[str, int]]:
    """The file's bytes, and where each structure ends (for truncations at its boundaries)."""
    out = bytearray(parts.magic)
    ends = {"magic": len(out)}
    out += struct.pack("<I", parts.version % 2**32)
    ends["version"] = len(out)
    for name, count, true in (("tensor count", parts.n_tensors, len(parts.tensors)),
                              ("kv count", parts.n_kv, len(parts.kvs))):
        out += struct.pack("<Q", (true if count is None else count) % 2**64)
        ends[name] = len(out)
    for kv in parts.kvs:
        key = kv.key.encode("utf-8", "surrogatepass")
        out += struct.pack("<Q", (len(key) if kv.key_length is None else kv.key_length) % 2**64)
        ends[f"key of {kv.key}"] = len(out) + len(key) // 2
        out += key + struct.pack("<I", kv.value.vtype % 2**32)
        ends[f"type of {kv.key}"] = len(out)
        value = _encode_value(kv.value)
        ends[f"inside {kv.key}"] = len(out) + max(1, len(value) // 2)
        out += value
        ends[f"kv {kv.key}"] = len(out)
    for t in parts.tensors:
        name = t.name.encode("utf-8", "surrogatepass")
        out += struct.pack("<Q", len(name)) + name
        ends[f"name of tensor {t.name}"] = len(out)
        out += struct.pack("<I", (len(t.dims) if t.n_dims is None else t.n_dims) % 2**32)
        out += b"".join(struct.pack("<Q", d % 2**64) for d in t.dims)
        ends[f"shape of tensor {t.name}"] = len(out)
        out += struct.pack("<IQ", t.ttype % 2**32, t.offset % 2**64)
        ends[f"info of tensor {t.name}"] = len(out)
    out += b"\0" * (-len(out) % parts.pad_to)
    ends["data start"] = len(out)
    start = len(out)
    out += parts.data
    for t in parts.tensors:
        ends[f"inside data of {t.name}"] = start + t.offset + 7
    ends["last byte"] = len(out) - 1
    return bytes(out), ends


# ---- mutations ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutated:
    """A broken file: its bytes, what was done, whether the engine must refuse it."""
    raw: bytes
    what: str
    must_refuse: bool
    target: str = ""
    """What it changed (a key, a tensor, the tokenizer, the bytes): two mutations of one target
    may undo each other's lie, so neither verdict then stands."""
    canary: str | None = None
    """A file name a hostile template tries to create (it must not appear)."""


@dataclass(frozen=True)
class Mutation:
    what: str
    apply: Callable[[GGUFParts], Mutated]

    def __repr__(self) -> str:
        return self.what


def on_copy(what: str, change: Callable[[GGUFParts], tuple[str, bool] | bool],
             target: str | Callable[[GGUFParts], str]) -> Mutation:
    """A mutation of the parts: ``change`` edits a copy and says whether the engine must refuse
    the result (or returns (detail, must_refuse)); ``target``: what it changes (or a function of
    the parts naming it)."""
    def apply(parts: GGUFParts) -> Mutated:
        p = copy.deepcopy(parts)
        name = target(p) if callable(target) else target
        said = change(p)
        detail, must = said if isinstance(said, tuple) else ("", said)
        return Mutated(encode(p)[0], f"{what}{detail}", must, name)
    return Mutation(what, apply)


def _tensor_target(index: int) -> Callable[[GGUFParts], str]:
    return lambda p: f"tensor #{index % len(p.tensors)}"


def _key_target(key: str) -> str:
    """The tokenizer's keys are one target: their lies are judged together (_vocab_lies)."""
    return "tokenizer" if key.startswith("tokenizer.ggml.") else key


def truncation(index: int, delta: int) -> Mutation:
    """The file cut at structural boundary ``index`` (modulo their number), ``delta`` bytes
    either side."""
    def apply(parts: GGUFParts) -> Mutated:
        raw, ends = encode(parts)
        names = list(ends)
        name = names[index % len(names)]
        cut = max(0, min(len(raw) - 1, ends[name] + delta))
        return Mutated(raw[:cut], f"cut at {cut} ({name} {delta:+d})", True, "cut")
    return Mutation(f"cut at boundary #{index} {delta:+d}", apply)


def cut_at(boundary: str, delta: int = 0) -> Mutation:
    """The file cut ``delta`` bytes after the first boundary whose name starts with
    ``boundary`` (:func:`encode` names them: "magic", "kv count", "inside general.name", ...)."""
    def apply(parts: GGUFParts) -> Mutated:
        raw, ends = encode(parts)
        name = next(n for n in ends if n.startswith(boundary))
        return Mutated(raw[:ends[name] + delta], f"cut at {name} {delta:+d}", True, "cut")
    return Mutation(f"cut at {boundary} {delta:+d}", apply)


def magic(value: bytes) -> Mutation:
    return on_copy(f"magic {value!r}", lambda p: (setattr(p, "magic", value), value != b"GGUF")[1],
                    "magic")


def version(value: int) -> Mutation:
    return on_copy(f"version {value}",
                    lambda p: (setattr(p, "version", value), value % 2**32 not in (2, 3))[1],
                    "version")


def count(which: str, value: int, relative: bool) -> Mutation:
    def change(p: GGUFParts) -> tuple[str, bool]:
        true = len(p.tensors) if which == "n_tensors" else len(p.kvs)
        written = true + value if relative else value
        setattr(p, which, written)
        return f" = {written}", written % 2**64 != true
    return on_copy(f"{which} {'%+d' % value if relative else value}", change, which)


def _pick(items: list, index: int):
    return items[index % len(items)]


def tensor_offset(index: int, kind: str, value: int) -> Mutation:
    """beyond: far past the file; overlap: another tensor's; shift: moved by ``value`` bytes."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        t = _pick(p.tensors, index)
        old = t.offset
        if kind == "beyond":
            t.offset = value
        elif kind == "overlap":
            t.offset = _pick(p.tensors, index + 1 + value).offset
        else:
            t.offset = (t.offset + value) % 2**64
        return f": {t.name} {old} -> {t.offset}", t.offset != old
    return on_copy(f"tensor #{index} offset {kind} {value}", change,
                    _tensor_target(index))


def tensor_dims(index: int, dims: list[int] | str, n_dims: int | None) -> Mutation:
    """New dimensions (or "reversed", "doubled"), and a dimension count that may lie."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        t = _pick(p.tensors, index)
        old = list(t.dims)
        if dims == "reversed":
            t.dims = old[::-1]
        elif dims == "doubled":
            t.dims = [old[0] * 2] + old[1:]
        else:
            t.dims = list(dims)
        t.n_dims = n_dims
        lie = n_dims is not None and n_dims != len(t.dims)
        return f": {t.name} {old} -> {t.dims} (n_dims {n_dims})", lie or t.dims != old
    return on_copy(f"tensor #{index} dims {dims} n_dims {n_dims}", change,
                    _tensor_target(index))


def tensor_type(index: int, ttype: int) -> Mutation:
    def change(p: GGUFParts) -> tuple[str, bool]:
        t = _pick(p.tensors, index)
        old, t.ttype = t.ttype, ttype
        return f": {t.name} {old} -> {ttype}", not _same_layout(old, ttype)
    return on_copy(f"tensor #{index} type {ttype}", change,
                    _tensor_target(index))


def _same_layout(a: int, b: int) -> bool:
    """Types whose blocks have the same size, both dequantisable: one read as the other is
    another valid file (F16 as BF16), not a lie the engine can see."""
    known = {q.value: q for q in gguf.GGMLQuantizationType}
    if a not in known or b not in known:
        return a == b
    if gguf.GGML_QUANT_SIZES[known[a]] != gguf.GGML_QUANT_SIZES[known[b]]:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[known[b]][1]), np.uint8),
                               known[b])
    except NotImplementedError:
        return False
    return True


def tensor_name(index: int, name: str | int) -> Mutation:
    """A tensor renamed (an int: to the name of that other tensor, a duplicate)."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        t = _pick(p.tensors, index)
        old = t.name
        t.name = _pick(p.tensors, index + 1 + name).name if isinstance(name, int) else name
        return f": {old} -> {t.name!r}", t.name != old
    return on_copy(f"tensor #{index} renamed {name!r}", change,
                    _tensor_target(index))


def length_field(index: int, where: str, value: int) -> Mutation:
    """A length field that lies: a key's (``key``), a string value's or an array's count
    (``value``) of key-value ``index``."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        kv = _pick(p.kvs, index)
        if where == "key":
            kv.key_length = value
            return f": {kv.key}", value != len(kv.key.encode())
        v = kv.value
        if v.vtype == STRING:
            data = v.value.encode()
            v.raw = struct.pack("<Q", value % 2**64) + data
            return f": {kv.key} (string of {len(data)})", value != len(data)
        if v.vtype == ARRAY:
            etype, items = v.value
            body = b"".join(_encode_value(Value(etype, x)) for x in items)
            v.raw = struct.pack("<IQ", etype, value % 2**64) + body
            return f": {kv.key} (array of {len(items)})", value != len(items)
        v.raw = struct.pack("<Q", value % 2**64)  # 8 bytes where a scalar was
        return f": {kv.key} (a scalar, type {v.vtype})", False
    return on_copy(f"kv #{index} {where} length {value}", change,
                    lambda p: _key_target(_pick(p.kvs, index).key))


def lying_array(etype: int, claimed: int, index: int) -> Mutation:
    """A new key-value before key-value ``index``: an array of three ``etype`` items whose
    count says ``claimed`` (gguf.GGUFReader looped forever on a u8 array claiming 2**62)."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        items = ["a", "b", "c"] if etype == STRING else [1, 0, 1]
        body = b"".join(_encode_value(Value(etype, x)) for x in items)
        raw = struct.pack("<IQ", etype, claimed % 2**64) + body
        p.kvs.insert(index % len(p.kvs), KV("general.tags", Value(ARRAY, (etype, items), raw)))
        return "", claimed != len(items)
    return on_copy(f"array of type {etype} claiming {claimed} items", change, "general.tags")


def value_type(index: int, vtype: int) -> Mutation:
    """Key-value ``index`` claims another value type over the same bytes (an unknown type
    must be refused; a known one may happen to parse)."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        kv = _pick(p.kvs, index)
        old = kv.value.vtype
        kv.value = Value(vtype, kv.value.value, raw=_encode_value(kv.value))
        return f": {kv.key} {old} -> {vtype}", vtype > F64
    return on_copy(f"kv #{index} claims type {vtype}", change,
                    lambda p: _key_target(_pick(p.kvs, index).key))


def duplicate(index: int, same: bool) -> Mutation:
    """A key-value written twice (with the same value, or another key's value)."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        kv = _pick(p.kvs, index)
        value = kv.value if same else _pick(p.kvs, index + 1).value
        p.kvs.append(KV(kv.key, copy.deepcopy(value)))
        return f": {kv.key}", True
    return on_copy(f"kv #{index} duplicated ({'same' if same else 'other'} value)", change,
                    lambda p: _key_target(_pick(p.kvs, index).key))


# ---- metadata of the wrong type -----------------------------------------------------------------
INT_KEYS = ("llama.block_count", "llama.context_length", "llama.embedding_length",
            "llama.feed_forward_length", "llama.attention.head_count",
            "llama.attention.head_count_kv", "llama.attention.key_length",
            "llama.rope.dimension_count", "llama.vocab_size", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id")
FLOAT_KEYS = ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon")
STR_KEYS = ("general.architecture", "general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre",
            "tokenizer.chat_template", "llama.rope.scaling.type")
BOOL_KEYS = ("tokenizer.ggml.add_bos_token",)
ARRAY_KEYS = {"tokenizer.ggml.tokens": STRING, "tokenizer.ggml.merges": STRING,
              "tokenizer.ggml.token_type": I32}
"""The keys import reads, by the type it needs (of a llama file: the seeds are llama)."""
READ_KEYS = INT_KEYS + FLOAT_KEYS + STR_KEYS + BOOL_KEYS + tuple(ARRAY_KEYS)


def _kind(v: Value) -> str:
    if v.vtype in INTEGERS:
        return "int"
    return {F32: "float", F64: "float", BOOL: "bool", STRING: "str", ARRAY: "array"}[v.vtype]


def _wrong(key: str, v: Value) -> bool:
    """Whether import must refuse ``v`` as the value of ``key`` (its type is not one it reads
    there, or a number is not finite)."""
    kind = _kind(v)
    if key in INT_KEYS:
        return kind != "int"
    if key in FLOAT_KEYS:
        return kind not in ("int", "float") or not math.isfinite(v.value)
    if key in STR_KEYS:
        return kind != "str"
    if key in BOOL_KEYS:
        return kind != "bool"
    if key in ARRAY_KEYS:
        return kind != "array" or (bool(v.value[1]) and v.value[0] != ARRAY_KEYS[key]
                                   and not (ARRAY_KEYS[key] == I32 and v.value[0] in INTEGERS))
    if key == "general.alignment":  # another power of two may only move the data (undetectable)
        return v.vtype != U32 or not v.value or v.value & (v.value - 1) != 0
    return False


def _as_read(v: Value) -> Value:
    """``v`` with an integer wrapped to its type as a reader reads it back (2**63 as a u8 is 0,
    as an i64 -2**63), so that what the engine reads is what is judged."""
    if v.vtype not in INTEGERS or v.raw is not None:
        return v
    bits = 8 * struct.calcsize(_FORMATS[v.vtype])
    x = int(v.value) % 2**bits
    signed = v.vtype in (I8, I16, I32, I64)
    return Value(v.vtype, x - 2**bits if signed and x >= 2**(bits - 1) else x)


def set_value(key: str | int, v: Value) -> Mutation:
    """Key ``key`` (an int: the key-value at that index) set to ``v``, added if absent."""
    v = _as_read(v)

    def change(p: GGUFParts) -> tuple[str, bool]:
        name = _pick(p.kvs, key).key if isinstance(key, int) else key
        kv = p.kv(name)
        if kv is None:
            p.kvs.append(KV(name, v))
        else:
            kv.value = v
        return f": {name} = {_shown(v)}", _wrong(name, v) or _judged_with_vocab(name, p)
    return on_copy(f"set {key}", change, lambda p: _key_target(
        _pick(p.kvs, key).key if isinstance(key, int) else key))


def delete(key: str | int) -> Mutation:
    def change(p: GGUFParts) -> tuple[str, bool]:
        kv = _pick(p.kvs, key) if isinstance(key, int) else p.kv(key)
        if kv is None:
            return f": {key} (absent)", False
        p.kvs.remove(kv)
        return f": {kv.key}", kv.key in REQUIRED or _judged_with_vocab(kv.key, p)
    return on_copy(f"delete {key}", change, lambda p: _key_target(
        _pick(p.kvs, key).key if isinstance(key, int) else key))


REQUIRED = ("general.architecture", "llama.block_count", "llama.embedding_length",
            "llama.feed_forward_length", "llama.attention.head_count", "tokenizer.ggml.tokens",
            "tokenizer.ggml.model", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
"""Keys without which import has no model or no tokenizer (without token_type the special
tokens, <|im_end|>, would be split as text; a byte-level BPE has merges, as llama.cpp needs)."""


def _judged_with_vocab(key: str, p: GGUFParts) -> bool:
    """A change to a tokenizer key is judged with the whole tokenizer (:func:`_vocab_lies`)."""
    return key.startswith("tokenizer.ggml.") and _vocab_lies(p)


def _shown(v: Value) -> str:
    return repr(v.value)[:80] + (" (raw)" if v.raw is not None else "")


_scalar_values = st.one_of(
    st.builds(Value, st.sampled_from(INTEGERS),
              st.sampled_from([0, 1, -1, 7, 2**31, 2**32 - 1, 2**63, 10**6])),
    st.builds(Value, st.just(F32), st.sampled_from([0.0, -1.0, 1e-6, 1e30, math.inf, math.nan])),
    st.builds(Value, st.just(F64), st.floats(allow_nan=True, allow_infinity=True)),
    st.builds(Value, st.just(BOOL), st.sampled_from([0, 1, 2, 255])),
    st.builds(Value, st.just(STRING), st.one_of(st.sampled_from(["", "abc", "32", "llama",
                                                                 "\ud800"]),
                                                st.text(max_size=10))),
    st.builds(Value, st.just(STRING), st.sampled_from([b"\xff\xfe", b"a\x00b"])))
hostile_values = st.one_of(
    _scalar_values,
    st.builds(lambda e, xs: Value(ARRAY, (e, xs)), st.just(U32),
              st.lists(st.integers(0, 2**32 - 1), max_size=3)),
    st.builds(lambda xs: Value(ARRAY, (STRING, xs)), st.lists(st.text(max_size=4), max_size=3)),
    st.builds(lambda xs: Value(ARRAY, (ARRAY, [(U8, xs)])), st.lists(st.integers(0, 255),
                                                                     max_size=3)),
    st.just(Value(ARRAY, (F32, []))))
"""Metadata values of every GGUF type: absurd numbers, NaN, non-UTF-8 and lone-surrogate
strings, arrays (nested too)."""


# ---- the tokenizer ------------------------------------------------------------------------------
def _vocab_lies(p: GGUFParts) -> bool:
    """Whether the tokenizer arrays disagree: tokens and types of different lengths, no tokens,
    more tokens than the embedding has rows, a special token id outside the tokens."""
    arrays = [p.kv(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type")]
    if any(kv is None or kv.value.vtype != ARRAY for kv in arrays):
        return True
    tokens, types = (kv.value.value[1] for kv in arrays)
    rows = p.tensors[0].dims[1]  # token_embd.weight: (hidden, vocab) in GGUF order
    ids = [p.value(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")]
    return (len(tokens) != len(types) or not tokens or len(tokens) > rows
            or any(isinstance(i, int) and not 0 <= i < len(tokens) for i in ids))


def _resized(items: list, etype: int, by: int) -> list:
    if by < 0:
        return items[:max(0, len(items) + by)]
    return items + [f"<|x{i}|>" if etype == STRING else 1 for i in range(by)]


def tokenizer_array(key: str, change_by: int) -> Mutation:
    """One tokenizer array ``change_by`` entries shorter (negative) or longer than it was."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        kv = p.kv(key)
        etype, items = kv.value.value
        kv.value = Value(ARRAY, (etype, _resized(items, etype, change_by)))
        return f": {key} has {len(kv.value.value[1])}", _vocab_lies(p)
    return on_copy(f"{key} {change_by:+d}", change, "tokenizer")


def vocabulary(change_by: int) -> Mutation:
    """The tokens and their types both shortened (or grown): a vocabulary shorter than the
    embedding is taken (as llama.cpp takes padded embeddings) unless a special token id falls
    outside it; a longer one has ids without an embedding row."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            kv = p.kv(key)
            etype, items = kv.value.value
            kv.value = Value(ARRAY, (etype, _resized(items, etype, change_by)))
        n = len(p.value("tokenizer.ggml.tokens")[1])
        return f": {n} tokens, {p.tensors[0].dims[1]} rows", _vocab_lies(p)
    return on_copy(f"vocabulary {change_by:+d}", change, "tokenizer")


def merges(entries: list) -> Mutation:
    """Merges replaced: ``"a b"`` pairs of unknown tokens, no space, three parts, non-strings."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        etype = STRING if all(isinstance(e, str) for e in entries) else U32
        p.kv("tokenizer.ggml.merges").value = Value(ARRAY, (etype, entries))
        return f": {entries!r}"[:100], etype != STRING or _vocab_lies(p)
    return on_copy(f"merges {entries!r}"[:80], change, "tokenizer")


def token_text(index: int, text: str, add_bos: bool) -> Mutation:
    """Token ``index`` renamed ``text`` (a space, a colon, "$A", a control character; a lone
    surrogate is not UTF-8: a refusal), and bos prepended or not."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        tokens = p.kv("tokenizer.ggml.tokens").value.value[1]
        tokens[index % len(tokens)] = text
        p.kv("tokenizer.ggml.add_bos_token").value = Value(BOOL, int(add_bos))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return f": #{index % len(tokens)} = {text!r}", True
        return f": #{index % len(tokens)} = {text!r}", _vocab_lies(p)
    return on_copy(f"token #{index} = {text!r}, add_bos {add_bos}", change, "tokenizer")


CANARY = "escaped-the-sandbox"
SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch " + CANARY + "').read() }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch "
    + CANARY + "') }}",
    "{{ lipsum.__globals__['os'].popen('touch " + CANARY + "').read() }}",
    "{{ namespace.__init__.__globals__['__builtins__']['open']('" + CANARY + "', 'w') }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch "
    + CANARY + "') }}",
    "{{ (messages|attr('__class__')) }}",
    "{% set x = messages.pop() %}{{ x }}",
]
"""Templates that try to leave jinja2's sandbox, each by a known route."""


def chat_template(template: str) -> Mutation:
    def apply(parts: GGUFParts) -> Mutated:
        p = copy.deepcopy(parts)
        p.kv("tokenizer.chat_template").value = Value(STRING, template)
        return Mutated(encode(p)[0], f"chat_template {template!r}"[:120], False,
                       "tokenizer.chat_template", CANARY)
    return Mutation(f"chat_template {template!r}"[:80], apply)


def nan_weight(index: int, at: int) -> Mutation:
    """A NaN written over one float of tensor ``index`` (an F32 tensor; in a quantised one, its
    first block's f16 scale)."""
    def change(p: GGUFParts) -> tuple[str, bool]:
        t = _pick(p.tensors, index)
        data = bytearray(p.data)
        if t.ttype == 0:
            n = max(1, math.prod(t.dims))
            pos, nan = t.offset + 4 * (at % n), struct.pack("<f", math.nan)
        else:
            pos, nan = t.offset, struct.pack("<e", math.nan)  # Q8_0 / F16: an f16 first
        data[pos:pos + len(nan)] = nan
        p.data = bytes(data)
        return f": {t.name} at byte {pos}", True
    return on_copy(f"NaN in tensor #{index}", change, "data")


def byte_flip(at: int, value: int) -> Mutation:
    """One byte of the header changed (anything may follow; only the property is checked)."""
    def apply(parts: GGUFParts) -> Mutated:
        raw, ends = encode(parts)
        pos = at % ends["data start"]
        out = bytearray(raw)
        out[pos] = value
        return Mutated(bytes(out), f"byte {pos} = {value}", False, "bytes")
    return Mutation(f"byte #{at} = {value}", apply)


# ---- strategies ---------------------------------------------------------------------------------
_u64_lies = st.sampled_from([0, 1, 2**31, 2**32, 2**62, 2**63, 2**64 - 1])
_tensor = st.integers(0, 100)
_kv = st.integers(0, 100)
_GGML_TYPES = [0, 1, 2, 3, 4, 5, 8, 10, 12, 14, 15, 24, 26, 28, 30, 31, 33, 39, 40, 41, 42, 99,
               2**31, 2**32 - 1]
HOSTILE_TEMPLATES = SANDBOX_ESCAPES + [
    "{% for %}", "{{ messages[0]['content'] }}", "{{ raise_exception('no') }}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**9 }}", "{{ 9 ** (10 ** 10) }}", "{{ '%400000000s' % 'x' }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "plain text", "",
    "{{ " * 2000, "{% if %}" * 3]

structure_mutations = st.one_of(
    st.builds(truncation, st.integers(0, 200), st.integers(-3, 3)),
    st.builds(magic, st.one_of(st.sampled_from([b"GGML", b"gguf", b"FUGG", b"\0\0\0\0",
                                                b"GGJT"]), st.binary(min_size=4, max_size=4))),
    st.builds(version, st.one_of(st.sampled_from([0, 1, 2, 4, 0x30000, 2**31, 2**32 - 1]),
                                 st.integers(0, 2**32 - 1))),
    st.builds(count, st.sampled_from(["n_tensors", "n_kv"]), st.integers(-3, 3), st.just(True)),
    st.builds(count, st.sampled_from(["n_tensors", "n_kv"]), _u64_lies, st.just(False)),
    st.builds(tensor_offset, _tensor, st.just("beyond"), st.sampled_from(
        [10**6, 2**40, 2**63, 2**64 - 1])),
    st.builds(tensor_offset, _tensor, st.just("overlap"), st.integers(0, 40)),
    st.builds(tensor_offset, _tensor, st.just("shift"), st.sampled_from(
        [1, 2, 4, 31, 32, 64, -32, -1])),
    st.builds(tensor_dims, _tensor, st.one_of(
        st.sampled_from(["reversed", "doubled", [], [0], [0, 0], [2**64 - 1], [2**63],
                         [2**32, 2**32], [1, 1, 1, 1, 1], [32, 384, 1]]),
        st.lists(st.one_of(st.integers(0, 500), _u64_lies), max_size=5)),
        st.one_of(st.none(), st.sampled_from([0, 5, 2**31, 2**32 - 1]))),
    st.builds(tensor_type, _tensor, st.one_of(st.sampled_from(_GGML_TYPES),
                                              st.integers(0, 2**32 - 1))),
    st.builds(tensor_name, _tensor, st.one_of(st.integers(0, 40), st.sampled_from(
        ["", "blk.0.attn_q.weight.extra", "token_embd.weight\x00", "\ud800"]))),
    st.builds(length_field, _kv, st.sampled_from(["key", "value"]),
              st.one_of(_u64_lies, st.integers(0, 3000))),
    st.builds(lying_array, st.sampled_from(INTEGERS + (F32, BOOL, STRING)),
              st.one_of(_u64_lies, st.integers(0, 5)), _kv),
    st.builds(value_type, _kv, st.one_of(st.sampled_from([13, 14, 99, 2**32 - 1]),
                                         st.integers(0, 12))),
    st.builds(duplicate, _kv, st.booleans()),
    st.builds(byte_flip, st.integers(0, 10**5), st.integers(0, 255)),
    st.builds(nan_weight, _tensor, st.integers(0, 10**4)))
"""Mutations of the file's structure: what a cut, corrupted or lying file looks like."""

metadata_mutations = st.one_of(
    st.builds(set_value, st.one_of(st.sampled_from(READ_KEYS + ("general.alignment",)), _kv),
              hostile_values),
    st.builds(set_value, st.just("general.alignment"), st.builds(
        Value, st.sampled_from([U32, U64, I32]), st.sampled_from([0, 1, 3, 16, 32, 64, 2**31,
                                                                  2**32 - 1]))),
    st.builds(delete, st.one_of(st.sampled_from(READ_KEYS), _kv)),
    st.builds(tokenizer_array, st.sampled_from(list(ARRAY_KEYS)),
              st.sampled_from([-10**6, -100, -1, 1, 5])),
    st.builds(vocabulary, st.sampled_from([-383, -130, -100, -5, -1, 1, 7])),
    st.builds(merges, st.lists(st.one_of(st.sampled_from(["a b", "abc", "a b c", "", " ",
                                                          "zz yy", "\u0120 \u0120"]),
                                         st.text(max_size=5)), max_size=4)),
    st.builds(merges, st.lists(st.integers(0, 9), min_size=1, max_size=2)),
    st.builds(token_text, st.one_of(st.integers(0, 4), st.integers(0, 400)), st.one_of(
        st.sampled_from(["a b", "x:y", "$A", "$B:1", "", " ", "<|im_end|>", "\ud800", "\x00"]),
        st.text(max_size=6)), st.booleans()),
    st.builds(chat_template, st.one_of(st.sampled_from(HOSTILE_TEMPLATES), st.text(max_size=30))))
"""Mutations of the metadata: wrong types, absurd values, tokenizer arrays that disagree,
hostile templates."""

mutations = st.lists(st.one_of(structure_mutations, metadata_mutations), min_size=1, max_size=2)
"""One or two mutations of one file (applied in turn: the second to what the first made, as
long as that still parses)."""


def apply_all(seed: GGUFParts, chosen: list[Mutation]) -> Mutated:
    """The mutations in turn; a later one applies to the file the earlier ones made when that
    still parses as GGUF here, else it is dropped. The file must be refused when one of them
    lies and no other touched what it changed."""
    result, done = chosen[0].apply(seed), []
    done.append(result)
    for m in chosen[1:]:
        try:
            result = m.apply(parse(result.raw))
        except (struct.error, UnicodeDecodeError, KeyError, ValueError, MemoryError,
                OverflowError, IndexError, AttributeError, TypeError, ZeroDivisionError):
            break  # the first left nothing this one can edit
        done.append(result)
    targets = [d.target for d in done]
    return Mutated(result.raw, "; ".join(d.what for d in done),
                   any(d.must_refuse and targets.count(d.target) == 1 for d in done), "",
                   next((d.canary for d in done if d.canary), None))


# ---- the property -------------------------------------------------------------------------------
class Hang(BaseException):
    """Raised by the alarm (a BaseException: product code's ``except Exception`` cannot eat it)."""


@contextmanager
def bounded(seconds: int, extra_bytes: int):
    """Fail a call that runs past ``seconds`` (SIGALRM: :class:`Hang`) or asks for more than
    ``extra_bytes`` of address space beyond what the process has now (MemoryError): a length
    field of 2**62 must not be allocated, nor a loop run for it."""
    def on_alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    limits = resource.getrlimit(resource.RLIMIT_AS)
    now = _address_space()
    resource.setrlimit(resource.RLIMIT_AS, (now + extra_bytes, limits[1]))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, limits)
        signal.signal(signal.SIGALRM, old)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    return kib * 1024


@dataclass
class Tally:
    """What the fuzz saw, per surface."""
    tried: int = 0
    lying: int = 0
    """Files that lie about themselves (each must be refused)."""
    imported: int = 0
    import_refused: int = 0
    template_refused: int = 0
    """Imported files whose chat template the sandbox then refused."""
    listed_supported: int = 0
    listed_unsupported: int = 0

    def line(self, wall: float) -> str:
        return (f"GGUF fuzzing: {self.tried} files ({self.lying} that lie about themselves); "
                f"import-gguf: {self.import_refused} refused naming the file, {self.imported} "
                f"imported and loaded ({self.template_refused} with a template the sandbox "
                f"refused); discovery: {self.listed_unsupported} unsupported naming the file, "
                f"{self.listed_supported} supported; 0 other exceptions, 0 hangs, 0 lying files "
                f"imported; {wall / max(1, self.tried) * 1000:.0f} ms per file")


PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}]
HANG_SECONDS, MEMORY_BYTES = 60, 2 << 30


def check_gguf(m: Mutated, tmp: Path, tally: Tally) -> None:
    """The property, for one broken file in an empty folder ``tmp``: discovery lists it (as
    unsupported with a reason naming it, or supported), never raising; import refuses it with
    one UserError naming it and leaves nothing behind, or imports a folder the engine loads.
    A file that lies about itself (``must_refuse``) must not import; discovery may call a file
    supported that import then refuses (it reads less), never the reverse."""
    from slideformer.engine.api import discover_models
    from slideformer.engine.gguf.importer import import_gguf
    from slideformer.engine.models.stores import Roots

    tally.tried += 1
    tally.lying += m.must_refuse
    scan = tmp / "scan"
    scan.mkdir()
    path = scan / "model.gguf"
    path.write_bytes(m.raw)
    nowhere = Roots(tmp / "no-hf-cache", (), ())
    with bounded(HANG_SECONDS, MEMORY_BYTES):
        rows = discover_models([scan], nowhere)
    assert len(rows) == 1, rows
    row = rows[0]
    if not row.supported:
        assert str(path) in row.reason, f"discovery's reason names another file: {row.reason}"
    out = tmp / "imported"
    try:
        with bounded(HANG_SECONDS, MEMORY_BYTES):
            import_gguf(path, out)
    except UserError as e:
        assert str(path) in str(e), f"{str(e)!r} does not name the file"
        assert sorted(p.name for p in tmp.iterdir()) == ["scan"], "import left files behind"
        tally.import_refused += 1
        tally.listed_unsupported += not row.supported
        tally.listed_supported += row.supported
        return
    assert not m.must_refuse, f"imported a file that lies ({m.what})"
    assert row.supported, f"discovery refused a file import takes: {row.reason}"
    tally.template_refused += not _use(out, m, tmp)
    tally.imported += 1
    tally.listed_supported += 1


def _use(out: Path, m: Mutated, tmp: Path) -> bool:
    """The imported folder loads as the engine loads a model: spec, weights, tokenizer (its
    ids within the embedding), and the chat template renders in the sandbox (True) or is
    refused by it, naming tokenizer_config.json (False)."""
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.tokenizer import check_vocab, load_tokenizer
    from slideformer.engine.models.weights import Checkpoint
    with bounded(HANG_SECONDS, MEMORY_BYTES):
        spec = load_spec(out)
        Checkpoint(out).check(spec)
        tok = load_tokenizer(out)
        check_vocab(tok, spec.vocab_size, out / "config.json")
        try:
            tok.render_chat(PROBE)
            rendered = True
        except UserError as e:
            assert "chat_template" in str(e) and "tokenizer_config.json" in str(e), str(e)
            rendered = False
    if m.canary is not None:
        assert not list(tmp.rglob(m.canary)) and not Path(m.canary).exists(), "sandbox escaped"
    return rendered
