"""Data formats, detection and override, real-world mess, and one clear error per bad input."""
from __future__ import annotations

import json

import pytest

from slideformer.engine.cli import main
from slideformer.engine.config import DataConfig
from slideformer.engine.data import preview, tokenize
from test_data_helpers import jsonl, prep, tiny_dir, tok, user_error, write  # noqa: F401

BOS, EOS = "<|begin_of_text|>", "<|im_end|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


def texts(tok, path, n=5, **kw) -> list[str]:
    """The model inputs of the first records, as previewed."""
    return ["".join(p for p, _ in s.pieces)
            for s in preview(DataConfig(train=str(path), **kw), tok, n).samples]


def trained(tok, path, **kw) -> list[str]:
    return ["".join(p for p, t in s.pieces if t)
            for s in preview(DataConfig(train=str(path), **kw), tok).samples]


# ---- formats -----------------------------------------------------------------------------------
def test_text_jsonl_json_and_txt(tok, tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [{"text": "one two"}, {"text": "three", "id": 7}])
    b = write(tmp_path / "b.json", json.dumps([{"text": "one two"}, {"text": "three"}], indent=2))
    c = write(tmp_path / "c.txt", "one two\n\n\nthree\n")
    for path in (a, b, c):
        assert texts(tok, path) == [f"{BOS}one two{EOS}", f"{BOS}three{EOS}"], path
        assert prep(tok, tmp_path / "cache", path, max_seq_len=16).stats.format == "text"
    # plain text trains every token after the first
    assert trained(tok, c) == ["one two" + EOS, "three" + EOS]


def test_txt_paragraphs_keep_inner_lines_and_folders_are_sorted(tok, tmp_path):
    write(tmp_path / "d" / "b.txt", "second file\n")
    write(tmp_path / "d" / "sub" / "c.txt", "third\n")
    write(tmp_path / "d" / "a.txt", "line one\nline two\n\npara two\n")
    write(tmp_path / "d" / "ignored.md", "not data\n")
    assert texts(tok, tmp_path / "d") == [f"{BOS}{t}{EOS}" for t in (
        "line one\nline two", "para two", "second file", "third")]


def test_alpaca_with_input_and_system(tok, tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [
        {"instruction": "Add", "input": "2 and 3", "output": "5", "system": "Be exact."},
        {"instruction": "Say hi", "output": "hi", "input": ""}])
    assert texts(tok, path) == [
        tok.render_chat([{"role": "system", "content": "Be exact."},
                         {"role": "user", "content": "Add\n\n2 and 3"},
                         {"role": "assistant", "content": "5"}]),
        tok.render_chat([{"role": "user", "content": "Say hi"},
                         {"role": "assistant", "content": "hi"}])]
    assert trained(tok, path) == ["5" + EOS, "hi" + EOS]


def test_messages_and_sharegpt_render_the_same(tok, tmp_path):
    m = jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}])
    s = jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"},
        {"from": "gpt", "value": "4"}]}])
    assert texts(tok, m) == texts(tok, s) == [tok.render_chat(CHAT)]
    assert prep(tok, tmp_path / "c", s, max_seq_len=64).stats.format == "sharegpt"
    assert prep(tok, tmp_path / "c", m, max_seq_len=64).stats.format == "messages"


def test_override_beats_detection(tok, tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [{"instruction": "Q", "output": "A", "text": "plain"}])
    err = user_error(prep, tok, tmp_path / "c", path, max_seq_len=64)  # detected: alpaca
    assert "field 'text'" in err.problem and "ignore_fields" in err.fix
    p = prep(tok, tmp_path / "c", path, max_seq_len=64, format="text",
             ignore_fields=("instruction", "output"))
    assert p.stats.format == "text"
    assert texts(tok, path, format="text", ignore_fields=("instruction", "output")) == \
        [f"{BOS}plain{EOS}"]


def test_real_world_mess(tok, tmp_path):
    """BOM, CRLF, blank and whitespace lines, unicode, a very long record."""
    long = "word " * 3000
    body = "\r\n".join([json.dumps({"text": "héllo wörld 😀 — ü"}), "", "   ",
                        json.dumps({"text": long}, ensure_ascii=False), ""])
    path = write(tmp_path / "m.jsonl", "\ufeff" + body)
    assert texts(tok, path, 1) == [f"{BOS}héllo wörld 😀 — ü{EOS}"]
    p = prep(tok, tmp_path / "c", path, max_seq_len=64)
    short = len(tok.tok.encode("héllo wörld 😀 — ü").ids) + 1  # BOS added, EOS appended
    n = len(tok.tok.encode(long).ids) + 1
    blocks = (n - 2) // 63 + 1  # plain text: blocks of 64 overlapping by one token
    assert (p.stats.records, p.stats.truncated, p.stats.split) == (2, 0, 1)
    assert p.train.tokens == short + n + blocks - 1 and p.stats.dropped_tokens == 0
    assert p.stats.trained_tokens == short - 1 + n - 1
    txt = write(tmp_path / "m.txt", "\ufeffpara one\r\nstill one\r\n\r\n  \r\npara two\r\n")
    assert texts(tok, txt) == [f"{BOS}para one\nstill one{EOS}", f"{BOS}para two{EOS}"]
    arr = write(tmp_path / "m.json", '\ufeff[\r\n {"text": "a"},\r\n\r\n {"text": "b"}\r\n]\r\n')
    assert texts(tok, arr) == [f"{BOS}a{EOS}", f"{BOS}b{EOS}"]


def test_blank_records_are_counted_not_trained(tok, tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [{"text": "fine"}, {"text": "  "}])
    p = prep(tok, tmp_path / "c", path, max_seq_len=16)
    assert (p.stats.records, p.stats.train_records, p.stats.no_target) == (2, 1, 1)


# ---- bad inputs: one message naming file and line ----------------------------------------------
BAD = [
    ("empty.jsonl", b"", "empty.jsonl", "is empty"),
    ("blank.jsonl", b"\n  \n", "blank.jsonl", "no records"),
    ("json.jsonl", b'{"text": "a"}\n{"text": "b",}\n', "json.jsonl:2", "not valid JSON"),
    ("list.jsonl", b'{"text": "a"}\n["text"]\n', "list.jsonl:2", "not an object"),
    ("utf8.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "utf8.jsonl:2", "not valid UTF-8"),
    ("utf8.txt", b"fine\n\nalso fine\nbad \xff byte\n", "utf8.txt:4", "not valid UTF-8"),
    ("utf8.json", b'[{"text": "a"},\n{"text": "\xff"}]', "utf8.json:2", "not valid UTF-8"),
    ("arr.json", b'[{"text": "a"},\n {"text": "b"}\n {"text": "c"}]', "arr.json:3", "expected ','"),
    ("nofmt.jsonl", b'{"prompt": "a", "completion": "b"}\n', "nofmt.jsonl:1", "fits no known"),
    ("missing.jsonl", b'{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n',
     "missing.jsonl:2", "no 'output' field (format alpaca, detected from line 1)"),
    ("type.jsonl", b'{"text": 5}\n', "type.jsonl:1", "'text' is a int, expected a str"),
    ("role.jsonl", b'{"messages": [{"role": "robot", "content": "x"}]}\n', "role.jsonl:1",
     "message 1 has role='robot'"),
    ("content.jsonl", b'{"messages": [{"role": "user", "content": ["x"]}]}\n',
     "content.jsonl:1", "message 1 has a content part that is not"),
    ("turns.jsonl", b'{"conversations": "hi"}\n', "turns.jsonl:1", "'conversations' is a str"),
    ("sgpt.jsonl", b'{"conversations": [{"from": "human"}]}\n', "sgpt.jsonl:1",
     "message 1 has a missing value 'value'"),
]


@pytest.mark.parametrize("name,content,where,problem", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_error(tok, tmp_path, name, content, where, problem):
    path = write(tmp_path / name, content)
    err = user_error(prep, tok, tmp_path / "cache", path)
    assert err.where.endswith(where) and problem in err.problem, str(err)
    assert err.fix and "\n" not in err.problem


def test_other_bad_inputs(tok, tmp_path):
    long = jsonl(tmp_path / "long.jsonl", [{"instruction": "short", "output": "x"},
                                           {"instruction": "word " * 100, "output": "y"}])
    err = user_error(prep, tok, tmp_path / "c", long, max_seq_len=32, truncation="error")
    assert err.where.endswith("long.jsonl:2") and "longer than max_seq_len = 32" in err.problem
    err = user_error(prep, tok, tmp_path / "c", long, max_seq_len=4, truncation="drop")
    assert "no records left after filtering" in err.problem and "max_seq_len" in err.fix
    noreply = jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    err = user_error(prep, tok, tmp_path / "c", noreply)
    assert "no records left" in err.problem and "train_on" in err.fix
    txt = write(tmp_path / "t.txt", "text\n")
    assert "is a .txt file" in user_error(prep, tok, tmp_path / "c", txt, format="alpaca").problem
    missing = tmp_path / "nope.jsonl"
    assert user_error(prep, tok, tmp_path / "c", missing).problem == "does not exist"
    assert "unsupported extension" in user_error(
        prep, tok, tmp_path / "c", write(tmp_path / "x.xml", "<a/>\n")).problem
    assert user_error(prep, tok, tmp_path / "c", long, format="chat").where == "data.format"
    assert user_error(prep, tok, tmp_path / "c", long, val_fraction=1.0).where == \
        "data.val_fraction"


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_inspect(tiny_dir, tmp_path, capsys):
    path = jsonl(tmp_path / "a.jsonl", [{"messages": CHAT}] * 3)
    args = ["data", "inspect", str(path), "--model", str(tiny_dir), "--max-seq-len", "64",
            "--cache-dir", str(tmp_path / "cache"), "--samples", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "format      messages (chat template: model)" in out
    assert "records     3" in out and "truncated   0" in out
    assert f"[[4{EOS}]]" in out and "record lengths" in out
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stats"]["records"] == 3 and report["stats"]["from_cache"] is True
    assert ["4" + EOS, True] in report["samples"][0]["pieces"]
    assert main(["data", "inspect", str(tmp_path / "none.jsonl"), "--model", str(tiny_dir)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_batch_of_only_blank_records(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize, "BATCH_RECORDS", 2)
    path = jsonl(tmp_path / "a.jsonl", [{"text": " "}, {"text": ""}, {"text": "kept"}])
    p = prep(tok, tmp_path / "cache", path, max_seq_len=16)
    assert (p.stats.records, p.stats.train_records, p.stats.no_target) == (3, 1, 2)
