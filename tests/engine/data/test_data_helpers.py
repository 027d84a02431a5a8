"""Fixtures and helpers shared by the tests/engine/data/test_data_*.py files (no tests here)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slideformer.engine.config import DataConfig
from slideformer.engine.data import prepare_data
from slideformer.engine.errors import UserError
from slideformer.engine.models.tiny import make_tiny_model
from slideformer.engine.models.tokenizer import TokenizerInfo, load_tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny llama folder: byte-level BPE, ChatML template, eos <|im_end|>."""
    return make_tiny_model(tmp_path_factory.mktemp("data-tiny") / "model")


@pytest.fixture(scope="session")
def tok(tiny_dir) -> TokenizerInfo:
    return load_tokenizer(tiny_dir)


def tokenizer_with(base: Path, out: Path, template: str | None, specials: tuple = (),
                   eos: str | None = None, bos: str | None = None) -> TokenizerInfo:
    """A tokenizer folder made from ``base``'s with another chat template and special tokens."""
    from tokenizers import Tokenizer
    out.mkdir(parents=True, exist_ok=True)
    t = Tokenizer.from_file(str(base / "tokenizer.json"))
    if specials:
        t.add_special_tokens(list(specials))
    t.save(str(out / "tokenizer.json"))
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    if template is not None:
        cfg["chat_template"] = template
    cfg["eos_token"] = eos or cfg["eos_token"]
    cfg["bos_token"] = bos if bos is not None else cfg["bos_token"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(out)


def write(path: Path, content: str | bytes) -> Path:
    """Write text exactly as given (no newline translation) or bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def jsonl(path: Path, records: list) -> Path:
    return write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def prep(tok: TokenizerInfo, cache: Path, train: Path, events: list | None = None, **kw):
    """prepare_data with a DataConfig of ``train`` and ``kw``."""
    cfg = DataConfig(train=str(train), **kw)
    return prepare_data(cfg, tok, cache, emit=None if events is None else events.append)


def user_error(fn, *args, **kw) -> UserError:
    """The UserError that ``fn(*args, **kw)`` raises (fails the test if none)."""
    with pytest.raises(UserError) as info:
        fn(*args, **kw)
    return info.value

