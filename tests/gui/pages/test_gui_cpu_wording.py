"""On the CPU backend the pages say what bounds a step in CPU terms: the Train page's line
next to Start and the Plan page's speed never say "GPU compute" for a plan whose device is the
CPU (and still do for a GPU plan)."""
from slideformer.engine.api import RunConfig, override, plan_for_config
from slideformer.gui.models.formatting import resource_title
from slideformer.gui.pages.plan.rows import busy_rows


def _plan(model, device: str, hardware: str):
    cfg = override(RunConfig(), {"model.path": str(model), "train.device": device,
                                 "data.max_seq_len": 64})
    return plan_for_config(cfg, hardware)


def test_a_cpu_plan_is_bound_by_cpu_compute_on_the_train_page(qtbot, window, tiny_llama):
    plan = _plan(tiny_llama, "cpu", "this")
    assert plan.device == "cpu" and plan.speed.bound == "gpu compute"  # the planner's name
    train = window.pages["Train"]
    window.ctx.use_plan(plan, {"data.max_seq_len": 64})
    text = train.plan_label.text()
    assert "bound by CPU compute" in text and "GPU compute" not in text
    rows = {r.key: r.title for r in busy_rows(plan)}
    assert rows["gpu compute"] == "CPU compute"


def test_a_gpu_plan_still_names_the_gpu(tiny_llama):
    plan = _plan(tiny_llama, "auto", "rtx4090")
    assert plan.device == "cuda"
    assert resource_title(plan.speed.bound, plan.device) != "CPU compute"
    assert {r.key: r.title for r in busy_rows(plan)}["gpu compute"] == "GPU compute"
