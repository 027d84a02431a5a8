"""The Model page against the engine's own report of a tiny model and of broken folders."""
import json
import shutil

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from slideformer.engine.errors import UserError
from slideformer.engine.models.commands import model_report
from slideformer.engine.models.spec import load_spec
from slideformer.gui.pages.model import ModelPage


@pytest.fixture
def page(qtbot, ctx):
    p = ModelPage(ctx)
    qtbot.addWidget(p)
    p.show()
    return p


def _load(qtbot, page, path):
    page.load(str(path))
    qtbot.waitUntil(lambda: page.status.property("state") in ("ok", "error"), timeout=10000)


def _engine_error(path) -> str:
    with pytest.raises(UserError) as e:
        model_report(path)
    return str(e.value)


def test_shows_the_engines_figures_for_a_tiny_llama(qtbot, page, ctx, tiny_llama):
    assert page.status.text().startswith("No model chosen yet")
    with qtbot.waitSignal(page.model_selected, timeout=10000) as selected:
        page.load(str(tiny_llama))
    assert selected.args == [str(tiny_llama)]
    s = load_spec(tiny_llama).summary()
    f = {k: v.text() for k, v in page.fields.items()}
    assert f["Family"].startswith("Llama") and f"model_type {s['family']}" in f["Family"]
    assert f["Layers"] == f"{s['layers']}: {s['layers']} full"
    assert f["Hidden size"].startswith(f"{s['hidden']} ")
    assert f["Attention heads"].startswith(f"{s['heads']} query / {s['kv_heads']} key-value")
    assert f["Vocabulary"] == f"{s['vocab']:,} tokens"
    assert f["Parameters"].startswith(f"{s['parameters']:,} ")
    assert f["Data type"].startswith(s["dtype"])
    assert f["Tied embeddings"] == ("yes" if s["tied_embeddings"] else "no")
    assert f["Size on disk"].endswith("MiB")
    assert page.status.property("state") == "ok"
    assert ctx.model_path == str(tiny_llama) and ctx.model_report["layers"] == s["layers"]
    assert ctx.settings.recent_models() == [str(tiny_llama)]
    assert page.recent.count() == 1 and not page.no_recent.isVisible()


def test_a_bnb_4bit_folder_says_its_weights_are_pre_quantised(qtbot, page, tiny_llama,
                                                             bnb4_folder_factory):
    folder = bnb4_folder_factory(tiny_llama)
    _load(qtbot, page, folder)
    assert page.status.property("state") == "ok"
    text = page.fields["Data type"].text()
    assert text == f"bfloat16  (weights stored as {model_report(folder)['weights_dtype']})"
    assert "pre-quantised NF4 (bitsandbytes)" in text


def test_missing_config_shows_the_engines_message_verbatim(qtbot, page, ctx, tmp_path):
    broken = tmp_path / "no-config"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"")
    _load(qtbot, page, broken)
    assert page.status.property("state") == "error"
    assert page.status.text() == _engine_error(broken)
    assert "config.json" in page.status.text() and "is missing" in page.status.text()
    assert all(v.text() == "—" for v in page.fields.values())
    assert ctx.model_path is None and ctx.settings.recent_models() == []


def test_unknown_model_type_shows_the_engines_message_verbatim(qtbot, page, tmp_path, tiny_llama):
    broken = tmp_path / "gpt2-ish"
    shutil.copytree(tiny_llama, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (broken / "config.json").write_text(json.dumps(cfg))
    _load(qtbot, page, broken)
    assert page.status.text() == _engine_error(broken)
    assert "'gpt2' is not supported" in page.status.text()


def test_a_stale_answer_does_not_overwrite_a_newer_choice(qtbot, page, tmp_path, tiny_llama):
    page.load(str(tmp_path / "does-not-exist"))
    with qtbot.waitSignal(page.model_selected, timeout=10000):
        page.load(str(tiny_llama))
    qtbot.wait(50)
    assert page.status.property("state") == "ok"


def test_recent_models_are_remembered_and_reopened(qtbot, ctx, tiny_llama, tmp_path):
    ctx.settings.add_recent_model(str(tmp_path / "elsewhere"))
    ctx.settings.add_recent_model(str(tiny_llama))
    page = ModelPage(ctx)
    qtbot.addWidget(page)
    assert [page.recent.item(i).data(Qt.ItemDataRole.UserRole) for i in range(2)] == [
        str(tiny_llama), str(tmp_path / "elsewhere")]
    with qtbot.waitSignal(page.model_selected, timeout=10000):
        page.recent.itemClicked.emit(page.recent.item(0))


def test_dropping_a_folder_chooses_it(qtbot, page, tiny_llama):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(tiny_llama / "config.json"))])  # a file: its folder
    drop = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime,
                      Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    with qtbot.waitSignal(page.model_selected, timeout=10000) as selected:
        page.dropEvent(drop)
    assert selected.args == [str(tiny_llama)]


def test_create_demo_model_makes_and_selects_it(qtbot, page, ctx):
    with qtbot.waitSignal(page.model_selected, timeout=60000) as selected:
        page.tiny_action.trigger()  # "Create demo model" > "Tiny random Llama"
        assert not page.demo_button.isEnabled()
    assert selected.args == [str(ctx.demo_model_dir)]
    assert load_spec(ctx.demo_model_dir).model_type == "llama"
    assert page.demo_button.isEnabled() and page.status.property("state") == "ok"


def test_import_gguf_makes_a_new_folder_and_selects_it(qtbot, page, ctx, tiny_llama, tmp_path):
    from slideformer.engine.gguf.exporter import export_gguf
    f = export_gguf(tiny_llama, tmp_path / "tiny.gguf", "q8_0")
    (ctx.models_dir / "tiny").mkdir(parents=True)  # a folder of that name is kept, not replaced
    with qtbot.waitSignal(page.model_selected, timeout=60000) as selected:
        page.import_gguf(str(f))
        assert not page.gguf_button.isEnabled() and page.status.property("state") == "busy"
    assert selected.args == [str(ctx.models_dir / "tiny-2")]
    assert load_spec(ctx.models_dir / "tiny-2").num_layers == load_spec(tiny_llama).num_layers
    assert page.gguf_button.isEnabled() and page.status.property("state") == "ok"


def test_import_of_a_bad_gguf_shows_the_engines_message(qtbot, page, ctx, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    page.import_gguf(str(bad))
    qtbot.waitUntil(lambda: page.status.property("state") == "error", timeout=60000)
    assert "bad.gguf could not be imported" in page.status.text()
    assert "cannot be read as GGUF" in page.status.text()


def test_real_demo_entry_follows_the_installed_package(page):
    from slideformer.engine.gguf.installed import smollm2_gguf
    assert page.real_action.isEnabled() == (smollm2_gguf() is not None)
