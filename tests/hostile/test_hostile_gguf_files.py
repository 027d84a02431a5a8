"""Hostile inputs, category GGUF files: cut, lying or mistyped GGUF files through ``import-gguf``
and the discovery scan (hostile_gguf.py).

Each case runs ``slideformer`` in-process: a refusal exits 2 with one message naming the file
and what is wrong; a scan lists the file as unsupported, naming it (exit 0). Every case is
quick (none trains), so the successes run in the default suite too.
"""
from __future__ import annotations

import pytest
from hostile_corpus import make_workspace, run_in_process
from hostile_gguf import GGUF_FILES


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-gguf"))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in GGUF_FILES])
def test_gguf_files_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
