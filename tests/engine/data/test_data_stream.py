"""Packing, padding, validation split, the token cache, and exact resume of the batch stream."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

import slideformer.engine.data.cache as cache_mod
import slideformer.engine.data.prepare as prepare_mod
from slideformer.engine.config import DataConfig
from slideformer.engine.data import IGNORE, BatchStream, iterate_eval, tokenize
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.store import TokenStore
from slideformer.engine.events import Progress
from test_data_helpers import jsonl, prep, tiny_dir, tok, tokenizer_with, user_error  # noqa: F401

N_RECORDS, SEQ = 60, 64


def records(n: int = N_RECORDS) -> list[dict]:
    return [{"text": f"record {i} " + "sum of the data " * (i % 5)} for i in range(n)]


@pytest.fixture
def data(tmp_path):
    return jsonl(tmp_path / "data.jsonl", records())


def documents(tok, dataset) -> list[list[int]]:
    """Every document of every row, cut out by doc_ids, with its labels checked on the way."""
    out = []
    mb = dataset.batch(range(len(dataset)))
    doc_ids = mb.doc_ids
    if doc_ids is None:  # one document per row, then padding
        doc_ids = (mb.input_ids == tok.pad_id).long()
    for ids, labels, doc in zip(mb.input_ids.tolist(), mb.labels.tolist(), doc_ids.tolist()):
        bounds = [0] + [t for t in range(1, SEQ) if doc[t] != doc[t - 1]] + [SEQ]
        for a, b in zip(bounds, bounds[1:]):
            if set(ids[a:b]) == {tok.pad_id}:  # padding: never trained
                assert set(labels[a:b]) == {IGNORE} and b == SEQ
            else:  # a document: shifted labels, none on its last token
                assert labels[a:b - 1] == ids[a + 1:b] and labels[b - 1] == IGNORE
                out.append(ids[a:b])
    return out


def expected_docs(tok, recs) -> list[list[int]]:
    return [tok.tok.encode(r["text"]).ids + [tok.eos_id] for r in recs]


@pytest.mark.parametrize("packing", [True, False])
def test_rows_hold_every_document_whole(tok, tmp_path, data, packing):
    p = prep(tok, tmp_path / "cache", data, max_seq_len=SEQ, packing=packing)
    got = documents(tok, p.train)
    assert sorted(got) == sorted(expected_docs(tok, records()))
    assert p.stats.train_sequences == len(p.train)
    if packing:
        assert len(p.train) <= 1.1 * p.stats.tokens / SEQ + 1  # near the optimum
        assert any(p.train.batch([r]).doc_ids is not None for r in range(len(p.train)))
    else:
        assert len(p.train) == N_RECORDS and p.train.batch(range(8)).doc_ids is None
    assert p.stats.tokens == sum(map(len, got))
    assert p.stats.trained_tokens == sum(len(d) - 1 for d in got)


def test_padding_gets_its_own_document_id(tok, tmp_path):
    path = jsonl(tmp_path / "two.jsonl", [{"text": "one"}, {"text": "two"}])
    p = prep(tok, tmp_path / "cache", path, max_seq_len=SEQ)
    mb = p.train.batch([0])
    n = 2 * len(expected_docs(tok, [{"text": "one"}])[0])
    assert mb.doc_ids[0].tolist() == [0] * (n // 2) + [1] * (n // 2) + [2] * (SEQ - n)
    assert set(mb.input_ids[0, n:].tolist()) == {tok.pad_id}
    assert mb.num_targets == n - 2


def test_validation_split_and_file(tok, tmp_path, data):
    a = prep(tok, tmp_path / "cache", data, max_seq_len=SEQ, val_fraction=0.2, seed=3)
    b = prep(tok, tmp_path / "cache2", data, max_seq_len=SEQ, val_fraction=0.2, seed=3)
    assert (a.stats.train_records, a.stats.val_records) == (48, 12)
    train, val = documents(tok, a.train), documents(tok, a.val)
    assert not set(map(tuple, train)) & set(map(tuple, val))
    assert sorted(train + val) == sorted(expected_docs(tok, records()))
    assert val == documents(tok, b.val), "the split is seeded"
    c = prep(tok, tmp_path / "cache", data, max_seq_len=SEQ, val_fraction=0.2, seed=4)
    assert documents(tok, c.val) != val
    vfile = jsonl(tmp_path / "val.jsonl", records(5))
    d = prep(tok, tmp_path / "cache", data, max_seq_len=SEQ, validation=str(vfile))
    assert sorted(documents(tok, d.val)) == sorted(expected_docs(tok, records(5)))
    assert d.stats.train_records == N_RECORDS
    batches = list(iterate_eval(d.val, 3))
    assert sum(len(mb.input_ids) for mb in batches) == len(d.val)
    assert torch.equal(torch.cat([mb.input_ids for mb in batches]),
                       d.val.batch(range(len(d.val))).input_ids)


def test_cache_hit_change_and_crash(tok, tmp_path, data, monkeypatch):
    calls = []
    real_build = prepare_mod.build_store
    monkeypatch.setattr(prepare_mod, "build_store", lambda *a: calls.append(1) or real_build(*a))
    cache = tmp_path / "cache"
    events = []
    first = prep(tok, cache, data, events, max_seq_len=SEQ)
    progress = [e for e in events if isinstance(e, Progress)]
    assert calls == [1] and not first.stats.from_cache
    assert progress[-1].done == progress[-1].total == data.stat().st_size
    assert [e.done for e in progress] == sorted(e.done for e in progress)
    events.clear()
    again = prep(tok, cache, data, events, max_seq_len=SEQ)
    assert calls == [1] and again.stats.from_cache
    assert not any(isinstance(e, Progress) for e in events)
    assert documents(tok, again.train) == documents(tok, first.train)
    # another sequence length re-uses the tokens
    other = prep(tok, cache, data, max_seq_len=2 * SEQ)
    assert calls == [1] and other.stats.from_cache and len(other.train) < len(first.train)
    # one changed byte invalidates
    data.write_text(data.read_text().replace("record 5 ", "record 6 "))
    changed = prep(tok, cache, data, max_seq_len=SEQ)
    assert calls == [1, 1] and not changed.stats.from_cache
    # a crash mid-build leaves no entry and no temporary folder behind
    def crash(files, fmt, tok_, train_on, folder, emit, task):
        (folder / "tokens.bin").write_bytes(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare_mod, "build_store", crash)
    with pytest.raises(KeyboardInterrupt):
        prep(tok, cache, data, max_seq_len=SEQ, train_on="all")
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
    monkeypatch.setattr(prepare_mod, "build_store", real_build)
    assert not prep(tok, cache, data, max_seq_len=SEQ, train_on="all").stats.from_cache


def test_a_full_disk_while_tokenising_is_one_message_and_leaves_nothing(tok, tmp_path, data,
                                                                         monkeypatch):
    """Was: OSError [Errno 28] with a traceback from the token store's write."""
    import errno

    def full(files, fmt, tok_, train_on, folder, emit, task):
        (folder / "tokens.bin").write_bytes(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(prepare_mod, "build_store", full)
    cache = tmp_path / "cache"
    err = user_error(prep, tok, cache, data, max_seq_len=SEQ)
    assert err.where == str(cache) and "ran out of disk space" in err.problem
    assert "4.0 KiB written" in err.problem and "output.run_dir" in err.fix
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name or p.name.startswith("tokens-")]


def test_source_hash_is_remembered_for_settled_files(tok, tmp_path, data, monkeypatch):
    hashed = []
    real = cache_mod.content_hash
    monkeypatch.setattr(cache_mod, "content_hash", lambda files: hashed.append(1) or real(files))
    os.utime(data, (time.time() - 60, time.time() - 60))
    for _ in range(3):
        assert prep(tok, tmp_path / "cache", data, max_seq_len=SEQ)
    assert hashed == [1], "hashed once, then remembered"
    data.write_text(data.read_text().replace("record 5 ", "record 6 "))  # a fresh mtime
    assert not prep(tok, tmp_path / "cache", data, max_seq_len=SEQ).stats.from_cache
    assert prep(tok, tmp_path / "cache", data, max_seq_len=SEQ).stats.from_cache
    assert hashed == [1, 1, 1], "a just-modified file is hashed on every open"


def test_tokenizer_change_invalidates(tok, tiny_dir, tmp_path):
    path = jsonl(tmp_path / "chat.jsonl", [{"instruction": "a", "output": "b"}])
    prep(tok, tmp_path / "cache", path, max_seq_len=SEQ)
    other = tokenizer_with(tiny_dir, tmp_path / "tok", "{% for m in messages %}"
                           "{{ m['content'] }}\n{% endfor %}")
    assert not prep(other, tmp_path / "cache", path, max_seq_len=SEQ).stats.from_cache
    assert prep(other, tmp_path / "cache", path, max_seq_len=SEQ).stats.from_cache


def run(stream: BatchStream, steps: int) -> list:
    return [stream.next_step() for _ in range(steps)]


def same(a: list, b: list) -> bool:
    def eq(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    return len(a) == len(b) and all(
        eq(m.input_ids, n.input_ids) and eq(m.labels, n.labels) and eq(m.doc_ids, n.doc_ids)
        for s, t in zip(a, b) for m, n in zip(s, t))


def test_batch_stream_epochs_and_resume(tok, tmp_path, data):
    ds = prep(tok, tmp_path / "cache", data, max_seq_len=SEQ, packing=False).train
    stream = BatchStream(ds, micro_batch=3, grad_accum=2, seed=7)
    assert stream.steps_per_epoch == N_RECORDS // 6
    spe = stream.steps_per_epoch
    reference = run(stream, 2 * spe + 3)
    assert all(len(step) == 2 and step[0].input_ids.shape == (3, SEQ) for step in reference)
    first_epoch = torch.cat([m.input_ids for step in reference[:spe] for m in step])
    assert len({tuple(r) for r in first_epoch.tolist()}) == spe * 6, "no row twice in an epoch"
    assert not same(reference[:spe], reference[spe:2 * spe]), "epochs are reshuffled"
    for cut in (4, spe, spe + 1, 2 * spe - 1):  # mid-epoch, at and after an epoch boundary
        s = BatchStream(ds, micro_batch=3, grad_accum=2, seed=7)
        assert same(run(s, cut), reference[:cut])
        state = json.loads(json.dumps(s.state_dict()))
        resumed = BatchStream(ds, micro_batch=3, grad_accum=2, seed=7)
        resumed.load_state_dict(state)
        assert resumed.epoch == pytest.approx(cut / spe)
        assert same(run(resumed, len(reference) - cut), reference[cut:]), cut
    other = BatchStream(ds, micro_batch=2, grad_accum=2, seed=7)
    assert "micro_batch" in user_error(other.load_state_dict, state).problem
    assert "fewer than one" in user_error(BatchStream, ds, micro_batch=40, grad_accum=2).problem


def test_worker_processes_match_the_thread(tok, tiny_dir, tmp_path, monkeypatch):
    """The process pool (large sources on many cores) writes byte-identical stores, in order."""
    monkeypatch.setattr(tokenize, "BATCH_RECORDS", 7)  # many batches in flight at once
    chats = [{"messages": [{"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": "a" * (i % 9)}]} for i in range(40)]
    for name, recs in (("text.jsonl", records()), ("chat.jsonl", chats)):
        path = jsonl(tmp_path / name, recs)
        stores = []
        for processes in (0, 2):
            folder = tmp_path / f"{name}-{processes}"
            folder.mkdir()
            meta = tokenize.build_store([path], DataConfig(), tok, ChatRenderer(tok), folder,
                                        None, "t", processes=processes)
            (folder / "meta.json").write_text(json.dumps(meta))
            stores.append(TokenStore(folder))
        a, b = stores
        assert a.meta == b.meta and np.array_equal(a.offsets, b.offsets)
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.mask, b.mask)
        assert np.array_equal(a.origin, b.origin)
    # a worker's UserError reaches the caller as the same one message
    hostile = tokenizer_with(tiny_dir, tmp_path / "tok", "{{ ''.__class__.__mro__ }}")
    (tmp_path / "h").mkdir()
    err = user_error(tokenize.build_store, [path], DataConfig(), hostile, ChatRenderer(hostile),
                     tmp_path / "h", None, "t", processes=2)
    assert "refused by the sandbox" in err.problem
