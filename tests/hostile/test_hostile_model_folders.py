"""Hostile inputs, category model folders: config.json windows and RoPE types of the wrong type,
index files naming what is not a shard, tokenizers whose special tokens do not survive encoding,
templates that render no reply, lying safetensors headers (hostile_folders.py).

Each case runs ``slideformer`` in-process and must exit 2 with one message naming the file and
the field (tests/hostile/hostile_corpus.py; test_hostile_corpus.py runs them in processes).
"""
from __future__ import annotations

import pytest
from hostile_corpus import make_workspace, params, run_in_process
from hostile_folders import MODEL_FOLDERS


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-model-folders"))


@pytest.mark.parametrize("case", params(MODEL_FOLDERS))
def test_model_folders_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
