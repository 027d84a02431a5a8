"""Every field of a record is used or the record is refused: the cases that used to train wrong
without a word, one test each, plus field mapping, mixing, max_samples and columnar files."""
from __future__ import annotations

import json

import pytest

from slideformer.engine.cli import main
from slideformer.engine.config import ColumnMap, DataConfig, MixSource
from slideformer.engine.data import preview
from test_data_helpers import jsonl, prep, tiny_dir, tok, user_error, write  # noqa: F401

EOS = "<|im_end|>"


def shown(tok, path, n=5, **kw):
    return preview(DataConfig(train=str(path), **kw), tok, n).samples


def text_of(sample) -> str:
    return "".join(p for p, _ in sample.pieces)


def trained_of(sample) -> list[str]:
    return [p for p, t in sample.pieces if t]


# ---- accepted and trained wrong before ---------------------------------------------------------
def test_alpaca_history_is_rendered_and_trained(tok, tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [{"instruction": "And 3+5?", "output": "8",
                                         "history": [["2+2?", "4"]], "system": "Be exact."}])
    s = shown(tok, path)[0]
    assert text_of(s) == tok.render_chat([
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+5?"},
        {"role": "assistant", "content": "8"}])
    assert trained_of(s) == ["4" + EOS, "8" + EOS]


def test_sharegpt_system_field_is_rendered(tok, tmp_path):
    path = jsonl(tmp_path / "s.jsonl", [{"system": "Be exact.", "conversations": [
        {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}])
    assert text_of(shown(tok, path)[0]) == tok.render_chat([
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}])
    both = jsonl(tmp_path / "b.jsonl", [{"system": "A", "conversations": [
        {"from": "system", "value": "B"}, {"from": "human", "value": "x"}]}])
    assert "both a 'system' field and a system message" in user_error(prep, tok, tmp_path / "c",
                                                                      both).problem


def test_weight_zero_replies_are_not_trained(tok, tmp_path):
    path = jsonl(tmp_path / "w.jsonl", [{"messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5", "weight": 0},
        {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "4", "weight": 1}]}])
    assert trained_of(shown(tok, path)[0]) == ["4" + EOS]
    p = prep(tok, tmp_path / "c", path, max_seq_len=256)
    assert p.stats.trained_tokens == len(tok.encode("4" + EOS))
    bad = jsonl(tmp_path / "b.jsonl", [{"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0.5}]}])
    assert "weight 0.5" in user_error(prep, tok, tmp_path / "c", bad).problem


def test_tool_calls_with_empty_content_are_kept(tok, tmp_path, tiny_dir):
    from test_data_templates import TEMPLATES, TOOL_CHAT
    from test_data_helpers import tokenizer_with
    qwen = tokenizer_with(tiny_dir, tmp_path / "qwen", (TEMPLATES / "qwen2.5.jinja").read_text(),
                          ("<|im_end|>",))
    chat = [dict(m, content="") if m.get("tool_calls") else m for m in TOOL_CHAT]
    path = jsonl(tmp_path / "t.jsonl", [{"messages": chat}])
    s = shown(qwen, path)[0]
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in trained_of(s)[0]
    # a template that cannot show tool calls refuses them instead of training an empty reply
    err = user_error(prep, tok, tmp_path / "c", path)
    assert err.where.endswith("t.jsonl:1") and "tool calls" in err.problem


@pytest.mark.parametrize("record,words", [
    ({"conversations": [{"from": "human", "value": "x"}], "chosen": {"from": "gpt", "value": "a"},
      "rejected": {"from": "gpt", "value": "b"}}, "preference data ('chosen'/'rejected'"),
    ({"prompt": "x", "chosen": "a", "rejected": "b"}, "preference data"),
    ({"chosen": [{"role": "user", "content": "x"}], "rejected": []}, "preference data"),
    ({"prompt": "x", "completion": "a", "label": False}, "KTO preference data"),
    ({"messages": [{"role": "user", "content": "x"}], "kto_tag": True}, "KTO preference data"),
], ids=["llamafactory-dpo", "trl-dpo", "trl-conversational", "trl-kto", "llamafactory-kto"])
def test_preference_data_is_refused(tok, tmp_path, record, words):
    path = jsonl(tmp_path / "p.jsonl", [record])
    err = user_error(prep, tok, tmp_path / "c", path)
    assert err.where.endswith("p.jsonl:1") and words in err.problem
    assert "supervised fine-tuning does not read" in err.problem and "--objective" in err.fix


@pytest.mark.parametrize("record,words", [
    ({"messages": [{"role": "user", "content": "<image>What is it?"},
                   {"role": "assistant", "content": "A cat."}], "images": ["cat.jpg"]},
     "'images' field"),
    ({"messages": [{"role": "user", "content": "<image>What is it?"},
                   {"role": "assistant", "content": "A cat."}]}, "<image> placeholder"),
    ({"instruction": "Transcribe <audio>", "output": "hello"}, "<audio> placeholder"),
    ({"conversations": [{"from": "human", "value": "<video>Describe"},
                        {"from": "gpt", "value": "A dog."}], "videos": ["a.mp4"]},
     "'videos' field"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x.png"}},
        {"type": "text", "text": "What?"}]}]}, "'image_url' content part"),
], ids=["images", "placeholder", "audio", "video", "openai-part"])
def test_multimodal_data_is_refused(tok, tmp_path, record, words):
    path = jsonl(tmp_path / "m.jsonl", [record])
    err = user_error(prep, tok, tmp_path / "c", path)
    assert err.where.endswith("m.jsonl:1") and words in err.problem
    assert "multimodal" in err.problem


def test_txt_without_blank_lines_is_cut_into_blocks(tok, tmp_path):
    lines = [f"line {i} of a book without paragraphs" for i in range(400)]
    path = write(tmp_path / "book.txt", "\n".join(lines) + "\n")
    n = len(tok.tok.encode("\n".join(lines)).ids) + 1  # BOS added, EOS appended
    p = prep(tok, tmp_path / "c", path, max_seq_len=64)
    blocks = (n - 2) // 63 + 1
    assert n > 10 * 64 and p.stats.split == 1 and p.stats.truncated == 0
    assert p.stats.trained_tokens == n - 1 and p.stats.dropped_tokens == 0
    assert len(p.train) == blocks and p.train.tokens == n + blocks - 1
    # the blocks hold the whole text, in order, each token trained once
    rows = [p.train.batch([r]) for r in range(len(p.train))]
    ids = [t for r in range(len(p.train)) for t in p.train.store.doc(0, 64, 63 * r)[0][1:]]
    targets = [int(x) for mb in rows for x in mb.labels[0] if x != -100]
    assert sorted(targets) == sorted(int(x) for x in ids) and len(targets) == n - 1
    # the preview reads only the head of so long a text, and shows exactly its first sequence
    s = shown(tok, path, max_seq_len=64)[0]
    assert s.partial and s.dropped == 0 and s.tokens < n
    full = tok.tok.encode("\n".join(lines))
    first = "".join(p for p, _ in s.pieces)
    assert first == tok.decode(full.ids[:64]) and len(tok.encode(first)) == 64
    s = shown(tok, path, max_seq_len=4096)[0]  # read whole
    assert (s.tokens, s.blocks, s.trained, s.dropped, s.partial) == (
        n, (n - 2) // 4095 + 1, n - 1, 0, False)


def test_preview_and_inspect_count_trained_and_dropped_tokens(tok, tiny_dir, tmp_path, capsys):
    long = "word " * 200
    path = jsonl(tmp_path / "a.jsonl", [{"instruction": "Hi", "output": "Hello"},
                                        {"instruction": long, "output": "ok"}])
    first, second = shown(tok, path, max_seq_len=64)
    assert first.dropped == 0 and first.trained == len(tok.encode("Hello" + EOS))
    assert second.tokens > 64 and second.dropped == second.tokens - 64 and second.trained == 0
    p = prep(tok, tmp_path / "c", path, max_seq_len=64)
    assert p.stats.no_target == 1 and p.stats.dropped_tokens == second.tokens
    args = ["data", "inspect", str(path), "--model", str(tiny_dir), "--max-seq-len", "64",
            "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{p.stats.trained_tokens:,} trained, {second.tokens:,} dropped" in out
    assert f"{second.tokens:,} tokens, 0 trained, {second.tokens - 64:,} dropped" in out


def test_unknown_fields_are_refused_with_file_line_and_fix(tok, tmp_path):
    path = jsonl(tmp_path / "u.jsonl", [{"instruction": "a", "output": "b"},
                                        {"instruction": "a", "output": "b", "rationale": "c"}])
    err = user_error(prep, tok, tmp_path / "c", path)
    assert err.where.endswith("u.jsonl:2") and "field 'rationale'" in err.problem
    assert "[data.columns]" in err.fix and "data.ignore_fields" in err.fix
    ok = prep(tok, tmp_path / "c", path, ignore_fields=("rationale",))
    assert ok.stats.records == 2
    msg = jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "x",
                                                      "image": "a.png"}]}])
    assert "message 1 has a field 'image'" in user_error(prep, tok, tmp_path / "c", msg).problem
    meta = jsonl(tmp_path / "id.jsonl", [{"id": "r1", "source": "web", "text": "fine"}])
    assert prep(tok, tmp_path / "c", meta).stats.records == 1  # id-like fields describe only


# ---- supported now -------------------------------------------------------------------------------
def test_column_and_role_mapping(tok, tmp_path):
    path = jsonl(tmp_path / "x.jsonl", [{"question": "2+2?", "answer": "4", "persona": "Be exact."},
                                        {"dialog": [{"speaker": "customer", "text": "hi"},
                                                    {"speaker": "bot", "text": "hello"}]}])
    alpaca = ColumnMap(prompt="question", response="answer", system="persona")
    one = write(tmp_path / "one.jsonl", path.read_text().splitlines()[0] + "\n")
    s = shown(tok, one, columns=alpaca)[0]
    assert text_of(s) == tok.render_chat([
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}])
    chat = ColumnMap(messages="dialog", role_tag="speaker", content_tag="text",
                     user_tag="customer", assistant_tag="bot")
    two = write(tmp_path / "two.jsonl", path.read_text().splitlines()[1] + "\n")
    s = shown(tok, two, columns=chat)[0]
    assert text_of(s) == tok.render_chat([{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello"}])
    assert trained_of(s) == ["hello" + EOS]


def test_mixed_sources_with_weights_counts_and_max_samples(tok, tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(10)])
    b = jsonl(tmp_path / "b.jsonl", [{"instruction": f"q{i}", "output": f"r{i}"}
                                     for i in range(10)])
    c = jsonl(tmp_path / "c.jsonl", [{"text": f"gamma {i}"} for i in range(10)])
    mix = (MixSource(str(b), weight=2.0), MixSource(str(c), samples=3))
    p = prep(tok, tmp_path / "cache", a, max_seq_len=64, packing=False, mix=mix)
    assert p.stats.format == "text + alpaca" and p.stats.records == 30
    assert len(p.train) == 10 + 20 + 3
    texts = [tok.decode([t for t in p.train.batch([r]).input_ids[0].tolist()
                         if t != tok.pad_id]) for r in range(len(p.train))]
    assert sum("gamma" in t for t in texts) == 3 and sum("alpha" in t for t in texts) == 10
    assert sum("r7" in t for t in texts) == 2  # weight 2: each record twice
    few = prep(tok, tmp_path / "cache", a, max_seq_len=64, max_samples=4, mix=mix)
    assert few.stats.records == 4 + 4 + 4
    held = prep(tok, tmp_path / "cache", a, max_seq_len=64, packing=False, mix=mix,
                val_fraction=0.2)
    assert held.stats.val_records == 2 + 2 + 2 and len(held.train) == 8 + 16 + 3


def test_csv_parquet_and_arrow_files(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.csv  # noqa: F401
    import pyarrow.parquet as pq
    rows = [{"instruction": "2+2?", "output": "4", "input": None},
            {"instruction": "007", "output": "agent", "input": "name"}]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "a.parquet")
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    write(tmp_path / "a.csv", 'instruction,output,input\n2+2?,4,\n007,agent,name\n')
    ref = shown(tok, jsonl(tmp_path / "a.jsonl", [{k: v for k, v in r.items() if v is not None}
                                                  for r in rows]))
    for name in ("a.parquet", "a.arrow", "a.csv"):
        got = shown(tok, tmp_path / name)
        assert [s.pieces for s in got] == [s.pieces for s in ref], name
    bad = write(tmp_path / "bad.csv", 'instruction,output\n"x,y\n')
    err = user_error(prep, tok, tmp_path / "c", bad)
    assert err.where.endswith("bad.csv") and "cannot be read as csv" in err.problem
    wrong = write(tmp_path / "w.csv", "instruction,output,extra\na,b,c\n")
    assert user_error(prep, tok, tmp_path / "c", wrong).where.endswith("w.csv:2")


def test_data_config_toml_round_trip(tmp_path):
    from slideformer.engine import config as config_mod
    cfg = config_mod.RunConfig(data=DataConfig(
        train="a.jsonl", ignore_fields=("x",), mask_history=True, enable_thinking=False,
        columns=ColumnMap(prompt="question", user_tag="customer"),
        mix=(MixSource("b.csv", weight=0.5), MixSource("c.parquet", samples=100))))
    path = tmp_path / "run.toml"
    path.write_text(config_mod.dumps(cfg))
    assert config_mod.load(path) == cfg
    assert "[data.columns]" in path.read_text() and "[[data.mix]]" in path.read_text()
    err = user_error(config_mod.from_dict, {"data": {"columns": {"nope": "x"}}}, "run.toml")
    assert "unknown key 'data.columns.nope'" in err.problem
