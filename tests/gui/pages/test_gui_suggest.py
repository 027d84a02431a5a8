"""The Train page's first-run path: choosing a model with the form untouched fills it with the
settings suggested for that model and machine (the engine's suggestion, visible as a preset);
an edited form is left alone until Suggest is pressed."""
from __future__ import annotations

from PySide6.QtCore import Qt

from slideformer.engine.api import suggest_settings


def shown(settings, values: dict) -> bool:
    cfg = settings.config()
    return all(getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) == v
               for k, v in values.items())


def test_a_first_model_gets_suggested_settings(qtbot, window, tiny_llama):
    page = window.pages["Train"]
    s = page.settings
    assert s.is_untouched()
    with qtbot.waitSignal(window.model_page.model_selected, timeout=20000):
        window.model_page.load(str(tiny_llama))
    qtbot.waitUntil(lambda: s.preset.currentText().startswith("Suggested for"), timeout=30000)
    expected = suggest_settings(str(tiny_llama), window.ctx.target)
    assert shown(s, expected.values)
    assert s.preset_note.text().startswith("Suggested: ") and expected.reasons[1] in \
        s.preset_note.text()
    # edited: another model choice does not overwrite the user's settings
    s.lr.setValue(3e-3)
    assert s.preset.currentText() == "Custom"
    page._first_suggestion()
    qtbot.wait(300)
    assert s.lr.value() == 3e-3
    # Suggest brings them back, and the suggestion stays listed once
    qtbot.mouseClick(s.suggest_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: shown(s, expected.values), timeout=30000)
    names = [s.preset.itemText(i) for i in range(s.preset.count())]
    assert sum(n.startswith("Suggested for") for n in names) == 1
