"""Tokenizer: GGUF metadata (``tokenizer.ggml.*``) <-> ``tokenizer.json`` + tokenizer_config.

A GGUF file has no tokenizer.json; llama.cpp stores the vocabulary, merges, token types, the
special token ids and the name of the pre-tokenizer (``tokenizer.ggml.pre``, how text is split
before BPE). Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: GPT-2, SmolLM, Llama 3,
Qwen) and SentencePiece BPE (``"llama"`` with per-token scores: Gemma) are imported; export
writes byte-level BPE.

The pre-tokenizers below are the ones llama.cpp names; each is written the way the original
model's tokenizer.json writes it, so that export can recognise it again (:func:`pre_name`).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from slideformer.engine.errors import UserError

# Split patterns of the original tokenizers (Llama 3 uses tiktoken's cl100k pattern; Qwen2
# the same with single digits; Qwen3.5 Qwen2's with combining marks (\p{M}) kept with letters).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = _QWEN2.replace(r"]?\p{L}+", r"]?[\p{L}\p{M}]+").replace(
    r" ?[^\s\p{L}\p{N}]+", r" ?[^\s\p{L}\p{M}\p{N}]+")


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=False)])


PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3),
    "qwen2": lambda: _split_then_bytes(_QWEN2),
    "qwen35": lambda: _split_then_bytes(_QWEN35),
}
"""llama.cpp pre-tokenizer name -> the tokenizers pre-tokenizer it stands for."""
# "gpt2": the name this exporter wrote before llama.cpp was checked (llama.cpp says "gpt-2")
PRE_ALIASES = {"default": "gpt-2", "gpt2": "gpt-2", "llama3": "llama-bpe", "llama-v3": "llama-bpe",
               "smaug-bpe": "llama-bpe", "deepseek-r1-qwen": "qwen2"}

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _pre_json(pre) -> dict:
    """A pre-tokenizer as JSON, without ``trim_offsets`` (it moves offsets, not ids)."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre
    return _drop_trim(json.loads(t.to_str())["pre_tokenizer"])


def _drop_trim(node):
    if isinstance(node, dict):
        return {k: _drop_trim(v) for k, v in node.items() if k != "trim_offsets"}
    if isinstance(node, list):
        return [_drop_trim(v) for v in node]
    return node


def build_tokenizer(meta: dict, where: Path) -> Tokenizer:
    """The ``tokenizers`` Tokenizer described by a GGUF file's tokenizer metadata.

    Args:
        meta: ``tokenizer.ggml.*`` keys without the prefix (tokens, merges, token_type, pre,
            model, bos_token_id, add_bos_token).
        where: the GGUF file (for messages).
    """
    kind = meta.get("model")
    if kind == "llama":
        return _sentencepiece(meta, where)
    if kind != "gpt2":
        raise UserError(where, f"has a {kind!r} tokenizer; byte-level BPE ('gpt2': Llama 3, "
                               "SmolLM, Qwen) and SentencePiece BPE ('llama': Gemma) can be "
                               "imported", "use a GGUF of a model with one of those tokenizers")
    pre = PRE_ALIASES.get(meta.get("pre", "default"), meta.get("pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise UserError(where, f"uses the pre-tokenizer {meta.get('pre')!r}, which is not "
                               f"supported", f"supported: {', '.join(PRE_TOKENIZERS)}")
    tokens, types = meta["tokens"], meta.get("token_type") or [NORMAL] * len(meta["tokens"])
    merges = [_merge(m, i, where) for i, m in enumerate(meta.get("merges", []))]
    tok = Tokenizer(_bpe(where, {t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    if not _added_and_bos(tok, meta, tokens, types):
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _added_and_bos(tok: Tokenizer, meta: dict, tokens: list, types: list) -> bool:
    """Control tokens stay whole and are special, user-defined ones stay whole (llama.cpp
    matches both before BPE); bos is prepended when the file says so (returns whether)."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos = meta.get("bos_token_id")
    if not (meta.get("add_bos_token") and bos is not None):
        return False
    # the template names bos by a key, not its text: a text with a space or a colon is not a
    # piece of a template ("Cannot build Piece from string")
    tok.post_processor = processors.TemplateProcessing(
        single="BOS $A", pair="BOS $A BOS $B",
        special_tokens=[{"id": "BOS", "ids": [bos], "tokens": [tokens[bos]]}])
    return True


def _merge(merge: str, i: int, where: Path) -> tuple[str, str]:
    """A merge "a b" as its pair, split at the first space after its first character (as
    llama.cpp splits it: a piece may itself be a space)."""
    at = merge.find(" ", 1)
    if at < 0:
        raise UserError(where, f"has the merge #{i} {merge[:40]!r} in tokenizer.ggml.merges, "
                        "which is not two pieces separated by a space",
                        "use a GGUF file whose tokenizer llama.cpp's converter wrote, unchanged")
    return merge[:at], merge[at + 1:]


def _bpe(where: Path, vocab: dict, merges: list, **options) -> models.BPE:
    """``models.BPE``; merges it cannot build (a piece that is not a token, a merge that is not
    two pieces) are one message naming the GGUF file."""
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as e:  # tokenizers raises plain Exception (and TypeError for a 1-tuple)
        raise UserError(where, f"has a vocabulary and merges that no BPE tokenizer can be built "
                        f"from ({str(e).splitlines()[0]})", "use a GGUF file whose tokenizer "
                        "llama.cpp's converter "
                        "wrote, unchanged") from None


def _sentencepiece(meta: dict, where: Path) -> Tokenizer:
    """A SentencePiece BPE vocabulary (llama.cpp's "llama" model: tokens, scores, types) as a
    ``tokenizers`` BPE with byte fallback, the way Gemma's own tokenizer.json is built.

    SentencePiece merges the adjacent pair whose merged piece scores highest; a BPE merge list
    ranked by the merged piece's score (every split of a piece into two pieces of the
    vocabulary) makes the same choices. Spaces are "▁" (U+2581); unknown bytes fall back to the
    ``<0xNN>`` byte tokens.
    """
    from tokenizers import normalizers
    tokens, scores = meta["tokens"], meta.get("scores") or [0.0] * len(meta["tokens"])
    types = meta.get("token_type") or [NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for t, i in vocab.items():
        if types[i] != NORMAL:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, vocab[a], a, b))
    merges = [(a, b) for *_, a, b in sorted(ranked)]
    unk = meta.get("unknown_token_id")
    tok = Tokenizer(_bpe(where, vocab, merges, byte_fallback=True, fuse_unk=True,
                         unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("add_space_prefix"))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _added_and_bos(tok, meta, tokens, types)
    return tok


def tokenizer_config(meta: dict, chat_template: str | None, max_len: int) -> dict:
    """tokenizer_config.json for the tokenizer of :func:`build_tokenizer`."""
    tokens = meta["tokens"]
    name = lambda key: tokens[meta[key]] if meta.get(key) is not None else None  # noqa: E731
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name("bos_token_id"),
           "eos_token": name("eos_token_id"), "pad_token": name("padding_token_id"),
           "unk_token": name("unknown_token_id"), "model_max_length": max_len,
           "add_bos_token": bool(meta.get("add_bos_token", False))}
    if chat_template:
        cfg["chat_template"] = chat_template
    return cfg


def pre_name(tokenizer_json: dict, where: Path) -> str:
    """The llama.cpp pre-tokenizer name of a tokenizer.json (for export)."""
    got = _drop_trim(tokenizer_json.get("pre_tokenizer"))
    for name, make in PRE_TOKENIZERS.items():
        if got == _pre_json(make()):
            return name
    raise UserError(where, "has a pre-tokenizer llama.cpp would not reproduce",
                    f"GGUF export supports the pre-tokenizers of {', '.join(PRE_TOKENIZERS)}")


def gguf_vocab(model_dir: Path, vocab_size: int) -> dict:
    """The ``tokenizer.ggml.*`` metadata (without the prefix) of a model folder's tokenizer.

    The token list is padded to ``vocab_size`` (the embedding's rows) with unused tokens,
    as llama.cpp's converter does.
    """
    path = model_dir / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _sentencepiece_vocab(tj, vocab_size, path)
    if model.get("type") != "BPE" or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise UserError(path, "is neither a byte-level nor a SentencePiece BPE tokenizer",
                        "GGUF export supports byte-level BPE (Llama 3, SmolLM, Qwen) and "
                        "SentencePiece BPE with byte fallback (Gemma)")
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    vocab = dict(model["vocab"]) | {a["content"]: i for i, a in added.items()}
    if max(vocab.values()) >= vocab_size:
        raise UserError(path, f"has token ids up to {max(vocab.values())}, beyond the "
                              f"model's vocab_size {vocab_size}", "use the model's own tokenizer")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for t, i in vocab.items():
        tokens[i] = t
        a = added.get(i)
        types[i] = NORMAL if a is None else CONTROL if a.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"model": "gpt2", "pre": pre_name(tj, path), "tokens": tokens, "token_type": types,
            "merges": merges}


def _sentencepiece_vocab(tj: dict, vocab_size: int, path: Path) -> dict:
    """llama.cpp's "llama" vocabulary of a SentencePiece BPE tokenizer.json: tokens, types
    (<0xNN> pieces are BYTE) and scores. llama.cpp merges by score, so the scores only need
    SentencePiece's order: a piece's is minus its id, as in Gemma's own file (its scores fall
    with the id), and -1000 for the pieces that never merge."""
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    vocab = dict(tj["model"]["vocab"]) | {a["content"]: i for i, a in added.items()}
    if max(vocab.values()) >= vocab_size:
        raise UserError(path, f"has token ids up to {max(vocab.values())}, beyond the "
                              f"model's vocab_size {vocab_size}", "use the model's own tokenizer")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types, scores = [UNUSED] * vocab_size, [-1000.0] * vocab_size
    for t, i in vocab.items():
        tokens[i], a = t, added.get(i)
        if a is not None:
            types[i] = CONTROL if a.get("special") else USER_DEFINED
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types[i] = BYTE
        else:
            types[i], scores[i] = NORMAL, -float(i)
    return {"model": "llama", "pre": "default", "tokens": tokens, "token_type": types,
            "scores": scores, "merges": []}
