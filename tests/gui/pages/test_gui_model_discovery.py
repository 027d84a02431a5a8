"""The Model page's "On this machine" table on a synthetic machine (a hub cache, an Ollama store,
a folder of the user's; the environment points at them, nothing of the user's is read): the
rows are the engine's, the scan is waited for on a worker thread while the planner process
computes it, and a picked row is opened and planned."""
from __future__ import annotations

import json
import os
import threading

import pytest
from PySide6.QtCore import Qt

from slideformer.engine.api import discover_models
from slideformer.engine.gguf.exporter import export_gguf
from slideformer.gui.models import found as found_model
from slideformer.gui.models.fit import VERDICT_TITLES
from slideformer.gui.models.formatting import human_bytes, human_count
from slideformer.gui.pages import model_found
from slideformer.gui.workers.planner import PlannerProcess, shared_planner
from tools.synthetic_stores import folder_files, hub_entry, ollama_entry

REAL_SCAN = model_found.scan  # tests/gui/conftest.py replaces it by an empty one

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MAMBA = {"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24}


@pytest.fixture
def machine(tmp_path, monkeypatch, tiny_llama):
    """The stores, the environment naming them, and a record of the threads scans were waited
    for on (the scan itself runs in the planner process)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setattr(model_found, "scan", REAL_SCAN)
    hub_entry(tmp_path / "hub", "org/tiny-llama", folder_files(tiny_llama))
    hub_entry(tmp_path / "hub", "state-spaces/mamba", {"config.json": json.dumps(MAMBA).encode()})
    ollama_entry(tmp_path / "ollama", "tinyllama:latest",
                 export_gguf(tiny_llama, tmp_path / "tiny.gguf", "q8_0"))
    threads = []
    call = PlannerProcess.call

    def recorded(self, fn, *args):
        if fn is discover_models:
            threads.append(threading.current_thread())
        return call(self, fn, *args)

    monkeypatch.setattr(PlannerProcess, "call", recorded)
    return threads


def _scanned(qtbot, box, scans=1):
    qtbot.waitUntil(lambda: box.scans >= scans and not box._scanning, timeout=60000)
    return {box.found.found(r).name: r for r in range(box.found.rowCount())}


def test_the_table_shows_the_engines_rows_scanned_on_a_worker(qtbot, machine, window,
                                                               qtmodeltester):
    box = window.model_page.found
    rows = _scanned(qtbot, box)
    assert set(rows) == {"org/tiny-llama", "state-spaces/mamba", "tinyllama:latest"}
    assert len(machine) == 1 and machine[0] is not threading.main_thread()
    assert machine[0].name == "model-discovery"
    assert shared_planner()._proc.pid != os.getpid()
    qtmodeltester.check(box.found)

    model = box.found
    cells = lambda r: [model.index(r, c).data() for c in range(model.columnCount())]  # noqa: E731
    llama = model.found(rows["org/tiny-llama"])
    assert cells(rows["org/tiny-llama"]) == [
        "org/tiny-llama", "HF cache", "llama", human_count(llama.total_params), llama.dtype,
        human_bytes(llama.size), *(VERDICT_TITLES[f.verdict] for f in llama.fits)]
    fit_col = model.columnCount() - 3
    assert model.index(rows["org/tiny-llama"], fit_col).data(Qt.ItemDataRole.ToolTipRole) \
        == llama.fits[0].reason
    assert cells(rows["tinyllama:latest"])[1:5] == ["Ollama", "llama", human_count(
        llama.total_params), "Q8_0"]

    mamba = model.found(rows["state-spaces/mamba"])
    grey = model.index(rows["state-spaces/mamba"], 0).data(Qt.ItemDataRole.ForegroundRole)
    assert grey.color().name() == found_model.UNSUPPORTED_COLOR
    assert mamba.reason.splitlines()[0].split(": ", 1)[1] in model.index(
        rows["state-spaces/mamba"], 2).data(Qt.ItemDataRole.ToolTipRole)
    box.table.selectRow(rows["state-spaces/mamba"])
    assert not box.use_button.isEnabled()
    assert "model_type 'mamba' is not supported" in box.detail.full_text()
    box.table.selectRow(rows["org/tiny-llama"])
    assert box.use_button.isEnabled()


def test_double_clicking_a_folder_row_opens_it_and_shows_the_plan_page(qtbot, machine, window):
    box = window.model_page.found
    row = _scanned(qtbot, box)["org/tiny-llama"]
    at = box.table.visualRect(box.found.index(row, 0)).center()
    with qtbot.waitSignal(window.model_page.plan_requested, timeout=30000):
        qtbot.mouseClick(box.table.viewport(), Qt.MouseButton.LeftButton, pos=at)  # as a
        qtbot.mouseDClick(box.table.viewport(), Qt.MouseButton.LeftButton, pos=at)  # hand does
    assert window.ctx.model_path == box.found.found(row).path
    assert window.stack.currentWidget() is window.pages["Plan"]


def test_use_on_a_gguf_row_imports_it_then_shows_the_plan_page(qtbot, machine, window):
    box = window.model_page.found
    box.table.selectRow(_scanned(qtbot, box)["tinyllama:latest"])
    with qtbot.waitSignal(window.model_page.plan_requested, timeout=180000):
        box.use_button.click()
    assert window.ctx.model_path == str(window.ctx.models_dir / "tinyllama-latest")
    assert window.ctx.model_report["family"] == "llama"
    assert window.stack.currentWidget() is window.pages["Plan"]


def test_added_folders_are_searched_and_remembered(qtbot, machine, window, ctx, tmp_path,
                                                   tiny_llama):
    import shutil
    shutil.copytree(tiny_llama, tmp_path / "mine" / "team-llama")
    box = window.model_page.found
    _scanned(qtbot, box)
    box.add_folder(str(tmp_path / "mine"))
    rows = _scanned(qtbot, box, scans=2)
    assert box.found.found(rows["team-llama"]).source == "folder"
    assert ctx.settings.model_folders() == [str(tmp_path / "mine")]
    assert len(machine) == 2 and all(t is not threading.main_thread() for t in machine)
    ctx.settings.remove_model_folder(str(tmp_path / "mine"))
    box.rescan()
    assert "team-llama" not in _scanned(qtbot, box, scans=3)
