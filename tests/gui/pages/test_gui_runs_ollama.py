"""The Runs page's "Send to Ollama…": ``ollama create`` on the run's newest GGUF export, off the
GUI thread, with a fake ``ollama`` on PATH (tests/conftest.py)."""
import os
import time

import pytest

from slideformer.gui.pages.gguf_actions import newest_export
from slideformer.gui.pages.runs import RunsPage


@pytest.fixture
def exported_run(ctx):
    """A run with a final model and two exports (the newer one is sent)."""
    run = ctx.runs_dir / "my-run"
    (run / "final").mkdir(parents=True)
    (run / "events.jsonl").write_text("")
    (run / "final" / "config.json").write_text("{}")
    for i, stem in enumerate(("my-run-q8_0", "my-run-bf16")):
        (run / f"{stem}.gguf").write_bytes(b"GGUF")
        (run / f"{stem}.Modelfile").write_text(f"FROM ./{stem}.gguf\n")
        t = time.time() - 100 + i
        os.utime(run / f"{stem}.Modelfile", (t, t))
    return run


def page_on(qtbot, ctx, run) -> RunsPage:
    page = RunsPage(ctx)
    qtbot.addWidget(page)
    page.show()
    qtbot.waitUntil(lambda: page.select(run), timeout=20000)
    return page


def test_send_to_ollama_creates_the_model(qtbot, ctx, exported_run, fake_ollama):
    record = fake_ollama("sleep 0.3; echo success")
    modelfile = newest_export(exported_run)
    assert modelfile == exported_run / "my-run-bf16.Modelfile"
    page = page_on(qtbot, ctx, exported_run)
    assert page.ollama_button.isEnabled()
    page.send_to_ollama(str(modelfile), "my-run")
    assert not page.ollama_button.isEnabled() and not page.export_button.isEnabled()
    qtbot.waitUntil(lambda: page.ollama_button.isEnabled(), timeout=20000)
    assert page.export_status.text() == "Ollama model my-run created: ollama run my-run"
    assert record.read_text().splitlines() == ["create", "my-run", "-f", str(modelfile.resolve())]


def test_without_ollama_the_page_says_how(qtbot, ctx, exported_run, fake_ollama):
    fake_ollama(None)
    page = page_on(qtbot, ctx, exported_run)
    page.send_to_ollama(str(newest_export(exported_run)), "my-run")
    qtbot.waitUntil(lambda: page.ollama_button.isEnabled(), timeout=20000)
    text = page.export_status.text()
    assert "ollama.com/download" in text and "ollama create my-run -f" in text


def test_ollama_failing_shows_its_message(qtbot, ctx, exported_run, fake_ollama):
    fake_ollama('echo "Error: could not connect to ollama app, is it running?" >&2; exit 1')
    page = page_on(qtbot, ctx, exported_run)
    page.send_to_ollama(str(newest_export(exported_run)), "my-run")
    qtbot.waitUntil(lambda: page.ollama_button.isEnabled(), timeout=20000)
    text = page.export_status.text()
    assert text.startswith("Send to Ollama failed:") and "could not connect" in text
    assert "my-run-bf16.Modelfile" in text and "start Ollama" in text


def test_nothing_exported_yet_says_export_first(qtbot, ctx, exported_run):
    for f in exported_run.glob("*.gguf"):
        f.unlink()
    assert newest_export(exported_run) is None
    page = page_on(qtbot, ctx, exported_run)
    page.send_selected_to_ollama()
    assert page.export_status.text().startswith("Export GGUF first")
