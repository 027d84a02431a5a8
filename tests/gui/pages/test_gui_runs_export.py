"""The Runs page's "Export GGUF…": a run's final model written as GGUF + Modelfile, off the GUI thread."""
import shutil

import pytest

from slideformer.engine.gguf.importer import import_gguf
from slideformer.engine.models.spec import load_spec
from slideformer.gui.pages.runs import RunsPage


@pytest.fixture
def run_with_final(ctx, tiny_llama):
    run = ctx.runs_dir / "my-run"
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("")
    shutil.copytree(tiny_llama, run / "final")
    return run


def test_export_gguf_of_a_runs_final_model(qtbot, ctx, run_with_final, tmp_path):
    page = RunsPage(ctx)
    qtbot.addWidget(page)
    page.show()
    qtbot.waitUntil(lambda: page.select(run_with_final), timeout=20000)
    assert page.export_button.isEnabled()
    page.export_run(str(run_with_final / "final"), "q8_0")
    assert not page.export_button.isEnabled()  # one export at a time
    qtbot.waitUntil(lambda: page.export_status.text().startswith("created"), timeout=60000)
    f = run_with_final / "my-run-q8_0.gguf"
    assert f.is_file() and (run_with_final / "my-run-q8_0.Modelfile").is_file()
    back = import_gguf(f, tmp_path / "back")
    assert load_spec(back).num_layers == load_spec(run_with_final / "final").num_layers
    # a second export never overwrites the first
    page.export_run(str(run_with_final / "final"), "q8_0")
    qtbot.waitUntil(lambda: page.export_button.isEnabled(), timeout=60000)
    assert (run_with_final / "my-run-q8_0-2.gguf").is_file()


def test_export_button_needs_a_final_model(qtbot, ctx, run_with_final):
    shutil.rmtree(run_with_final / "final")
    page = RunsPage(ctx)
    qtbot.addWidget(page)
    page.show()
    qtbot.waitUntil(lambda: page.select(run_with_final), timeout=20000)
    assert not page.export_button.isEnabled()
