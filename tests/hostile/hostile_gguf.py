"""Hostile corpus, category GGUF files: files cut short at each structural boundary, wrong magic
and versions, counts, offsets, shapes, types and length fields that lie, duplicate keys and
tensors, metadata of the wrong type, tokenizer arrays that disagree, NaN weights, templates that
do not compile or try to leave the sandbox; through ``import-gguf`` and through the discovery
scan (``slideformer models --folder``), which lists a broken file as unsupported, naming it.

Each case breaks the work folder's tiny model exported as GGUF, with the mutations of
gguf_fuzz.py (the fuzz that found them).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable

import gguf_fuzz as gf
from gguf_fuzz import (ARRAY, F32, STRING, U8, U32, U64, Value, count, cut_at, delete,
                       duplicate, lying_array, magic, merges, set_value, tensor_dims,
                       tensor_name, tensor_offset, tensor_type, tokenizer_array, version,
                       vocabulary)
from hostile_corpus import Case, train

GGUF = "model.gguf"
NOWHERE = {"HOME": "{w}", "HF_HUB_CACHE": "{w}/no-hf-cache", "OLLAMA_MODELS": "{w}/no-ollama"}
"""A scan of the work folder only: no store of this machine is listed."""


def gguf_file(*mutations: gf.Mutation, kind: str = "f32", rel: str = GGUF) -> Callable[[Path], None]:
    """Prepare a case: the work folder's model exported as GGUF (``kind``), mutated, at ``rel``."""
    def prepare(w: Path) -> None:
        from slideformer.engine.gguf.exporter import export_gguf
        seed = export_gguf(w / "model", w / "seed.gguf", kind)
        raw = seed.read_bytes()
        if mutations:
            raw = gf.apply_all(gf.parse(raw), list(mutations)).raw
        seed.unlink()
        (w / rel).parent.mkdir(parents=True, exist_ok=True)
        (w / rel).write_bytes(raw)
    return prepare


def imported(*mutations: gf.Mutation) -> Callable[[Path], None]:
    """Prepare a case: the mutated GGUF imported into ``imported/`` (import takes it)."""
    def prepare(w: Path) -> None:
        from slideformer.engine.gguf.importer import import_gguf
        gguf_file(*mutations)(w)
        import_gguf(w / GGUF, w / "imported")
    return prepare


def refused(name: str, words: tuple[str, ...], *mutations: gf.Mutation, kind: str = "f32") -> Case:
    """``import-gguf`` must refuse the file, naming it and the words."""
    return Case(name, ("import-gguf", GGUF, "--out", "imported"), (GGUF, *words),
                gguf_file(*mutations, kind=kind))


def listed(name: str, words: tuple[str, ...], *mutations: gf.Mutation) -> Case:
    """``slideformer models --folder ggufs`` lists the file as unsupported, with the words."""
    return Case(name, ("models", "--folder", "ggufs"), ("Not supported", GGUF, *words),
                gguf_file(*mutations, rel=f"ggufs/{GGUF}"), code=0, env=NOWHERE)


def _drop_last_token(p: gf.GGUFParts) -> tuple[str, bool]:
    """The vocabulary one token shorter than the embedding, with the merge that made it."""
    tokens, types, merged = (p.kv(f"tokenizer.ggml.{k}").value
                             for k in ("tokens", "token_type", "merges"))
    last = tokens.value[1].pop()
    types.value[1].pop()
    merged.value = (STRING, [m for m in merged.value[1] if m.replace(" ", "") != last])
    return f": {last!r}", False


PADDED = gf.on_copy("an embedding padded past the vocabulary", _drop_last_token, "tokenizer")
EMBED, LAST = 0, 20
"""Tensor indices: token_embd.weight (the first) and output.weight (the last)."""
_ESCAPE = gf.SANDBOX_ESCAPES[1]  # cycler.__init__.__globals__.os.popen('touch ...')
NESTED = Value(ARRAY, (U8, []), raw=struct.pack("<IQ", ARRAY, 1) * 20 + struct.pack("<IQ", U8, 0))
"""An array of an array ... 20 deep (recursion in a reader that follows it)."""

GGUF_FILES = [
    # ---- cut short at each structural boundary
    refused("cut inside the magic", ("does not start with the GGUF magic",), cut_at("magic", -2)),
    refused("cut inside the version", ("version", "cut short"), cut_at("version", -2)),
    refused("cut inside the tensor count", ("tensor count", "cut short"),
            cut_at("tensor count", -3)),
    refused("cut inside the key-value count", ("key-value count", "cut short"),
            cut_at("kv count", -3)),
    refused("cut inside a key", ("cut short",), cut_at("key of general.architecture")),
    refused("cut inside a value", ("cut short",), cut_at("inside general.name")),
    refused("cut inside the vocabulary", ("tokenizer.ggml.tokens",),
            cut_at("inside tokenizer.ggml.tokens")),
    refused("cut inside the tensor infos", ("tensor count", "cut short"),
            cut_at("shape of tensor blk.0.attn_q.weight", -4)),
    refused("cut inside the data", ("blk.1.ffn_up.weight", "cut short"),
            cut_at("inside data of blk.1.ffn_up.weight")),
    refused("one byte short", ("output.weight", "cut short"), cut_at("last byte")),
    # ---- magic, version, counts
    refused("GGML magic", ("GGUF magic",), magic(b"GGML")),
    refused("version 4", ("version 4",), version(4)),
    refused("version 1", ("version 1",), version(1)),
    refused("big-endian GGUF", ("big-endian",), version(0x03000000)),
    refused("tensor count one short", ("does not describe its data",), count("n_tensors", -1, True)),
    refused("tensor count 2**63", ("tensor count", "claims"), count("n_tensors", 2**63, False)),
    refused("key-value count 2**64 - 1", ("key-value count", "claims"),
            count("n_kv", 2**64 - 1, False)),
    # ---- tensor infos that lie
    refused("tensor data beyond the file", ("blk.0.attn_q.weight", "offset"),
            tensor_offset(2, "beyond", 2**40)),
    refused("tensor data overlapping another's", ("blk.0.attn_k.weight", "offset"),
            tensor_offset(3, "overlap", 0)),
    refused("tensor data misaligned", ("blk.0.attn_v.weight", "aligned to 32"),
            tensor_offset(4, "shift", 1)),
    refused("2**32 - 1 dimensions", ("token_embd.weight", "dimensions"),
            tensor_dims(EMBED, [32, 384], 2**32 - 1)),
    refused("a dimension of -1 (wrapped)", ("token_embd.weight", "shape"),
            tensor_dims(EMBED, [32, 2**64 - 1], None)),
    refused("a shape of 2**62 x 2**62", ("output.weight", "shape"),
            tensor_dims(LAST, [2**62, 2**62], None)),
    refused("no dimensions", ("does not describe its data",), tensor_dims(LAST, [], None)),
    refused("a dimension of 0", ("does not describe its data",),
            tensor_dims(LAST, [32, 0], None)),
    refused("unknown tensor type 99", ("unknown tensor type 99",), tensor_type(2, 99)),
    refused("tensor type Q8_K on rows shorter than its block", ("Q8_K", "block"),
            tensor_type(LAST, 15)),
    refused("two tensors of one name", ("two tensors",), tensor_name(3, 0)),
    # ---- metadata that lies
    refused("a string of 2**62 bytes", ("general.name", "claims"),
            gf.length_field(1, "value", 2**62)),
    refused("a key of 2**63 bytes", ("metadata key", "claims"), gf.length_field(2, "key", 2**63)),
    refused("a u8 array claiming 2**62 items", ("general.tags", "claims"),
            lying_array(U8, 2**62, 3)),
    refused("a string array claiming 2**62 items", ("general.tags", "claims"),
            lying_array(STRING, 2**62, 3)),
    refused("an unknown value type", ("unknown value type 99",), gf.value_type(2, 99)),
    refused("a key given twice", ("appears twice",), duplicate(2, False)),
    refused("arrays nested 20 deep", ("nests arrays",), set_value("general.tags", NESTED)),
    refused("general.alignment 0", ("general.alignment",), set_value(
        "general.alignment", Value(U32, 0))),
    refused("general.alignment 3", ("general.alignment",), set_value(
        "general.alignment", Value(U32, 3))),
    refused("general.alignment a u64", ("general.alignment",), set_value(
        "general.alignment", Value(U64, 32))),
    # ---- metadata of the wrong type
    refused("block_count a string", ("llama.block_count",), set_value(
        "llama.block_count", Value(STRING, "2"))),
    refused("block_count a float", ("llama.block_count",), set_value(
        "llama.block_count", Value(F32, 2.0))),
    refused("context_length a string", ("llama.context_length", "integer"), set_value(
        "llama.context_length", Value(STRING, "abc"))),
    refused("head_count_kv an array", ("llama.attention.head_count_kv",), set_value(
        "llama.attention.head_count_kv", Value(ARRAY, (U32, [1, 1])))),
    refused("rms epsilon NaN", ("layer_norm_rms_epsilon", "finite"), set_value(
        "llama.attention.layer_norm_rms_epsilon", Value(F32, float("nan")))),
    refused("architecture a number", ("general.architecture", "string"), set_value(
        "general.architecture", Value(U32, 7))),
    refused("bos_token_id a float", ("tokenizer.ggml.bos_token_id", "integer"), set_value(
        "tokenizer.ggml.bos_token_id", Value(F32, 1.5))),
    refused("add_bos_token a u8", ("tokenizer.ggml.add_bos_token", "boolean"), set_value(
        "tokenizer.ggml.add_bos_token", Value(U8, 2))),
    refused("tokens of numbers", ("tokenizer.ggml.tokens", "strings"), set_value(
        "tokenizer.ggml.tokens", Value(ARRAY, (U32, [1, 2, 3])))),
    refused("chat_template a number", ("tokenizer.chat_template", "string"), set_value(
        "tokenizer.chat_template", Value(U32, 5))),
    refused("vocab_size that the embedding does not have", ("llama.vocab_size", "rows"),
            set_value("llama.vocab_size", Value(U32, 1000))),
    # ---- the tokenizer
    refused("token types shorter than the tokens", ("token_type", "tokens"),
            tokenizer_array("tokenizer.ggml.token_type", -1)),
    refused("more tokens than embedding rows", ("tokens", "rows"), vocabulary(7)),
    refused("a vocabulary without its special tokens", ("eos_token_id",), vocabulary(-383)),
    refused("a vocabulary cut below its merges", ("merges",), vocabulary(-130)),
    Case("a vocabulary shorter than the embedding (padded) imports",
         ("import-gguf", GGUF, "--out", "imported"), ("created",), gguf_file(PADDED),
         code=0),
    Case("a bos token with a space and a colon imports", ("import-gguf", GGUF, "--out",
                                                          "imported"), ("created",),
         gguf_file(gf.token_text(0, "<s> x:y", True)), code=0),
    refused("bos_token_id beyond the tokens", ("bos_token_id",), set_value(
        "tokenizer.ggml.bos_token_id", Value(U32, 10**6))),
    refused("no token types", ("token_type",), delete("tokenizer.ggml.token_type")),
    refused("BPE without merges", ("merges",), delete("tokenizer.ggml.merges")),
    refused("merges an array of arrays (read flattened by gguf.GGUFReader)",
            ("tokenizer.ggml.merges", "strings"), set_value(
                "tokenizer.ggml.merges", Value(ARRAY, (ARRAY, [(U8, [])])))),
    listed("scan: merges an array of arrays", ("tokenizer.ggml.merges",), set_value(
        "tokenizer.ggml.merges", Value(ARRAY, (ARRAY, [(U8, [])])))),
    refused("merges of unknown tokens", ("merges",), merges(["zz yy"])),
    refused("a merge that is not a pair", ("merges",), merges(["abc"])),
    # ---- weights and the template
    refused("NaN in the weights", ("blk.0.attn_v.weight", "NaN"), gf.nan_weight(4, 3)),
    refused("NaN in a quantised block's scale", ("blk.0.attn_q.weight", "NaN"),
            gf.nan_weight(2, 0), kind="q8_0"),
    refused("a template that does not compile", ("tokenizer.chat_template", "compile"),
            gf.chat_template("{% for %}")),
    Case("an imported template escaping the sandbox", train("--model", "imported"),
         ("chat_template", "sandbox"), imported(gf.chat_template(_ESCAPE))),
    # ---- the discovery scan: an unsupported row naming the file, never an exception
    listed("scan: cut inside the data", ("cut short",),
           cut_at("inside data of blk.1.ffn_up.weight")),
    listed("scan: a u8 array claiming 2**62 items", ("claims",), lying_array(U8, 2**62, 3)),
    listed("scan: a key given twice", ("appears twice",), duplicate(2, False)),
    listed("scan: general.alignment 0", ("general.alignment",), set_value(
        "general.alignment", Value(U32, 0))),
    listed("scan: tensor data overlapping another's", ("offset",), tensor_offset(3, "overlap", 0)),
    listed("scan: block_count a string", ("llama.block_count",), set_value(
        "llama.block_count", Value(STRING, "2"))),
    listed("scan: a vocabulary without its special tokens", ("eos_token_id",), vocabulary(-383)),
    Case("scan: an intact file is supported", ("models", "--folder", "ggufs"), ("llama", "fits"),
         gguf_file(rel=f"ggufs/{GGUF}"), code=0, env=NOWHERE),
]
"""Named cases of the GGUF fuzz's findings (tests/hostile/test_gguf_fuzz.py)."""
