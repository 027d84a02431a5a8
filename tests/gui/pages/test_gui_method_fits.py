"""What fits for each method: the Model page's "What fits" box and the Plan page's line of
per-method verdicts show, for full fine-tuning, LoRA and QLoRA, the verdicts the planner itself
gives for the same model, settings and machine (a GPU preset, the same on every test machine;
the model is the published config.json of Llama-3.1-8B, nothing else is read)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from slideformer.engine.api import load_profile, override, plan_for_config, RunConfig
from slideformer.gui.models.fit import METHODS, VERDICT_TITLES
from test_gui_training import _never_ask  # noqa: F401

CONFIGS = Path(__file__).parents[2] / "fixtures" / "configs"
TARGET = "rtx4090"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def llama_8b(tmp_path) -> Path:
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    shutil.copy(CONFIGS / "llama-3.1-8b.json", folder / "config.json")
    return folder


def reference(model: Path, settings: dict, method: str):
    cfg = override(RunConfig(), {"model.path": str(model), **settings, "train.method": method})
    return plan_for_config(cfg, load_profile(TARGET))


def test_the_model_page_says_what_fits_for_each_method(qtbot, window, llama_8b):
    page = window.model_page
    fit = page.fit
    fit.target.setCurrentIndex(fit.target.findData(TARGET))
    assert window.ctx.target == TARGET  # one choice of machine for the Model and Plan pages
    with qtbot.waitSignal(page.model_selected, timeout=20000):
        page.load(str(llama_8b))
    qtbot.waitUntil(lambda: bool(fit.fits) and fit._asked is None
                    and all(v.isEnabled() for v in fit.verdicts.values()), timeout=120000)
    assert [f.method for f in fit.fits] == [m for m, _ in METHODS]
    settings = fit.settings()
    for f in fit.fits:
        # the same RAM budget: "auto" is what was available when the app's planner ran
        want = reference(llama_8b, {**settings, "budget.ram": str(f.ram_budget)}, f.method)
        assert f.verdict == want.verdict, f.method
        assert VERDICT_TITLES[f.verdict] in fit.verdicts[f.method].text()
    # the planner's answers differ by method: QLoRA's frozen 4-bit base needs the least memory
    full, _, qlora = fit.fits
    assert qlora.verdict != "does not fit" or full.verdict == "does not fit"
    plan = window.pages["Plan"]
    assert plan.inputs.target.currentData() == TARGET


def test_the_plan_page_shows_every_methods_verdict_and_plans_the_chosen_one(
        qtbot, window, llama_8b):
    window.model_page.fit.target.setCurrentIndex(
        window.model_page.fit.target.findData(TARGET))
    with qtbot.waitSignal(window.model_page.model_selected, timeout=20000):
        window.model_page.load(str(llama_8b))
    window.show_page("Plan")
    page = window.pages["Plan"]
    qtbot.waitUntil(lambda: page.machine is not None and page.machine.profile.preset == TARGET
                    and page.plan is not None and page.settled() and bool(page.method_fits)
                    and page.methods.isEnabled(), timeout=180000)
    settings = {k: v for k, v in page.inputs.settings().items() if k != "train.method"}
    for f in page.method_fits:
        assert f.verdict == reference(llama_8b, settings, f.method).verdict, f.method
        assert f"{f.title}: " in page.methods.text()

    page.inputs.method.setCurrentIndex(page.inputs.method.findData("qlora"))
    qtbot.waitUntil(lambda: page.settled() and page.plan.method == "qlora", timeout=60000)
    assert page.plan.verdict == reference(llama_8b, settings, "qlora").verdict
    qtbot.mouseClick(page.use_button, Qt.MouseButton.LeftButton)
    train = window.pages["Train"]
    assert train.settings.method.currentData() == "qlora"
