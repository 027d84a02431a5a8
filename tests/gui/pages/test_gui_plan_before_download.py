"""Plan before you download: a folder with only config.json is accepted for planning; the Train
page will not start it, and says why (offscreen, the engine's own report and planner)."""
import shutil

from slideformer.engine.config import DataConfig
from slideformer.engine.models.commands import CONFIG_ONLY, model_report


def test_a_config_only_folder_plans_but_does_not_train(qtbot, window, tiny_llama, tmp_path):
    folder = tmp_path / "Big-Model-70B"
    folder.mkdir()
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    assert model_report(folder, config_only=True)["config_only"] == CONFIG_ONLY
    page = window.model_page
    with qtbot.waitSignal(page.model_selected, timeout=20000):
        page.load(str(folder))
    assert page.status.property("state") == "info"
    assert page.status.text() == f"Plan only: {CONFIG_ONLY}."
    assert page.fields["Size on disk"].text() == "— (no weights yet)"
    assert window.ctx.model_path == str(folder)

    plan = window.pages["Plan"]
    window.show_page("Plan")
    qtbot.waitUntil(lambda: plan.plan is not None and plan.settled(), timeout=60000)
    assert plan.plan.total_params == model_report(tiny_llama)["parameters"]

    train = window.pages["Train"]
    window.ctx.set_data_config(DataConfig(train="data.jsonl"))  # a dataset is not what is missing
    assert not train.start_button.isEnabled()
    assert "no weights yet" in train.start_button.toolTip()
