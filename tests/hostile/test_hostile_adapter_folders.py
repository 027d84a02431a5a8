"""Hostile inputs, category adapter folders: broken LoRA adapter folders through
``slideformer chat`` and ``export-gguf`` (hostile_adapters.py).

Each case runs ``slideformer`` in-process: a refusal exits 2 with one message naming the
adapter's file and what is wrong; the successes are quick exports (none trains).
"""
from __future__ import annotations

import pytest
from hostile_adapters import ADAPTER_FOLDERS
from hostile_corpus import make_workspace, run_in_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-adapters"))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in ADAPTER_FOLDERS])
def test_adapter_folders_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
