"""One plan drives the run: "Use this plan" on the Plan page sets the Train page's run, which
names the plan next to Start and compares the measured speed with the predicted one; the run's
config.toml has the plan's shape and budgets (tiny model, CPU engine, offscreen)."""
import pytest
from PySide6.QtCore import Qt

from slideformer.engine import config as config_mod
from test_gui_training import _never_ask, choose_model_and_demo_data  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SHAPE = {"data.max_seq_len": 64, "train.micro_batch": 2, "train.grad_accum": 3,
         "budget.ram": "6GiB", "optim.moments_dtype": "bfloat16"}


def test_a_run_started_from_use_this_plan_has_the_plans_shape(qtbot, window, tiny_llama):
    choose_model_and_demo_data(qtbot, window, tiny_llama)
    window.show_page("Plan")
    plan_page, train = window.pages["Plan"], window.pages["Train"]
    qtbot.waitUntil(lambda: plan_page.plan is not None and plan_page.settled(), timeout=60000)
    plan_page.inputs.apply(SHAPE)
    assert plan_page.recomputing.isVisible() and not plan_page.results.isEnabled()  # stale
    qtbot.waitUntil(plan_page.settled, timeout=60000)
    assert not plan_page.recomputing.isVisible() and plan_page.results.isEnabled()
    plan = plan_page.plan
    assert plan.tokens_per_step == 64 * 2 * 3

    qtbot.mouseClick(plan_page.use_button, Qt.MouseButton.LeftButton)
    assert window.stack.currentWidget() is train
    s = train.settings
    assert (s.seq_len.value(), s.micro_batch.value(), s.grad_accum.value()) == (64, 2, 3)
    assert window.ctx.data_config.max_seq_len == 64
    assert "Plan: fits on this machine" in train.plan_label.text()
    assert f"predicted {plan.speed.tokens_per_s:,.0f} tokens/s" in train.plan_label.text()
    s.max_steps.setValue(3)  # not a plan setting: the plan still applies
    s.device.setCurrentIndex(s.device.findData("cpu"))
    assert train.plan_matches()

    qtbot.mouseClick(train.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: train.end is not None, timeout=400000)
    assert train.end.outcome == "finished", train.end
    saved = config_mod.load(train.run_dir / "config.toml")
    assert (saved.data.max_seq_len, saved.train.micro_batch, saved.train.grad_accum) == (64, 2, 3)
    assert saved.budget.ram == "6GiB" and saved.optim.moments_dtype == "bfloat16"
    assert "% of the prediction)" in train.plan_label.text()

    s.micro_batch.setValue(3)  # the user changes the shape: the plan no longer applies
    assert "The settings changed since" in train.plan_label.text()
