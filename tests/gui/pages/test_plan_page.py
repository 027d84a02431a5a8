"""The Plan page against the planner itself: the bars, verdict, fixes and speed it shows are
slideformer.engine.plan's for the same inputs, a fix makes the run fit, and the GUI thread never waits.

Model folders are a tiny Llama and the published config.json of real models (the planner reads
nothing else); speeds are the reference machine's (no profile is cached in the test's home).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PySide6.QtCore import QPointF, Qt
from PySide6.QtWidgets import QFileDialog

from slideformer.engine.config import RunConfig, override
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan import plan_run
from slideformer.gui.app import make_application
from slideformer.gui.models.formatting import human_bytes
from slideformer.gui.pages.plan.page import NO_MODEL, VERDICT_TITLES, PlanPage

CONFIGS = Path(__file__).parents[2] / "fixtures" / "configs"
TARGET = "rtx4090"
"""The machine the page plans for in these tests (a preset: the same on every test machine)."""
DESKTOP = {"budget.vram": "24GiB", "budget.ram": "128GiB", "data.max_seq_len": 2048,
           "train.micro_batch": 1, "train.grad_accum": 2}


@pytest.fixture(autouse=True)
def _reference_speeds(tmp_path, monkeypatch):
    """No measured hardware profile: the page and the reference plans use the same speeds."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setattr("slideformer.engine.plan.targets.gpu_memory", lambda: None)


@pytest.fixture
def page(qtbot, ctx):
    make_application()
    p = PlanPage(ctx)
    qtbot.addWidget(p)
    p.resize(1200, 900)
    p.show()
    qtbot.waitUntil(lambda: p.machine is not None, timeout=30000)
    p.inputs.target.setCurrentIndex(p.inputs.target.findData(TARGET))
    qtbot.waitUntil(lambda: p.machine.profile.preset == TARGET, timeout=30000)
    return p


def published(tmp_path: Path, name: str) -> Path:
    """A model folder holding only the published config.json of ``name``."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", folder / "config.json")
    return folder


def show(qtbot, page: PlanPage, model: Path, settings: dict) -> None:
    """Choose ``model``, set the inputs, and wait for the page to show their plan."""
    if page.ctx.model_path != str(model):
        page.ctx.set_model(str(model), {})
    page.inputs.apply(settings)
    qtbot.waitUntil(page.settled, timeout=240000)  # the planner process starts on a busy machine


def reference(model: Path, settings: dict):
    """The planner's own answer for the same inputs."""
    cfg = override(RunConfig(), {"model.path": str(model), **settings})
    return plan_run(cfg, load_spec(model), hardware=TARGET)


def test_page_opens_and_says_when_no_model_is_chosen(window, qtbot):
    window.show_page("Plan")
    page = window.pages["Plan"]
    assert isinstance(page, PlanPage) and page.isVisible()
    qtbot.waitUntil(lambda: page.machine is not None, timeout=10000)
    qtbot.waitUntil(lambda: page.status.text() == NO_MODEL)
    assert not page.results.isVisible() and page.plan is None


CASES = {
    "tiny-fits": ("tiny", {"budget.vram": "24GiB", "budget.ram": "64GiB", "data.max_seq_len": 128,
                           "train.micro_batch": 4, "train.grad_accum": 1}),
    "8b-tight": ("llama-3.1-8b", DESKTOP),
    "72b-does-not-fit": ("qwen2.5-72b-instruct", {**DESKTOP, "budget.checkpoints": "gpu"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bars_and_verdict_are_the_planners(qtbot, page, tiny_llama, tmp_path, case):
    name, settings = CASES[case]
    model = tiny_llama if name == "tiny" else published(tmp_path, name)
    show(qtbot, page, model, settings)
    ref = reference(model, settings)
    assert ref.verdict == case.split("-", 1)[1].replace("-", " ")

    assert page.plan.verdict == ref.verdict
    text = page.verdict.text()
    assert VERDICT_TITLES[ref.verdict] in text and ref.reason[1:] in text

    rows = {r.key: r for r in page.memory.rows}
    assert list(rows) == ["gpu", "host", "disk"]
    for use in ref.tiers:
        row = rows[use.tier]
        drawn = [(s.key, s.value) for s in row.segments]
        allocated = [(a.purpose, a.bytes) for a in ref.allocations if a.tier == use.tier]
        assert all(d in allocated for d in drawn)  # every segment is one of the plan's blocks
        assert sum(v for _, v in drawn) == use.peak  # ... and together they are its peak
        held = [(a.purpose, a.bytes) for a in ref.allocations
                if a.tier == use.tier and a.phase == "state" and a.bytes]
        assert all(h in drawn for h in held)  # what is held for the whole run is always drawn
        assert row.limit == (use.budget or None)
    # Drawn to scale: each segment's width is its share of the bar.
    for rect, seg in page.memory.segment_rects():
        row = next(r for r in page.memory.rows if seg in r.segments)
        full = max(row.limit or 0, sum(s.value for s in row.segments))
        assert rect.width() == pytest.approx(page.memory._bar_rect(0).width() * seg.value / full)

    assert [(r.key, r.segments[0].value if r.segments else 0.0) for r in page.busy.rows] == \
        list(ref.speed.busy)
    assert page.plan.speed == ref.speed and page.plan.max_micro_batch == ref.max_micro_batch
    assert f"{ref.speed.tokens_per_s:,.0f}" in page.speed.text()


def test_hovering_a_segment_names_it(qtbot, page, tmp_path):
    show(qtbot, page, published(tmp_path, "llama-3.1-8b"), DESKTOP)
    rect, seg = max(page.memory.segment_rects(), key=lambda rs: rs[0].width())
    assert seg.key == "AdamW moments m, v"
    tip = page.memory.tooltip_at(rect.center())
    assert "AdamW moments m, v" in tip and human_bytes(seg.value) in tip
    assert page.memory.tooltip_at(QPointF(2, 2)) == ""


@pytest.mark.parametrize("name,settings", [
    ("llama-3.1-8b", DESKTOP),  # tight: host RAM
    ("llama-3.2-3b", {"budget.vram": "24GiB", "budget.ram": "100GiB", "data.max_seq_len": 1024,
                      "train.micro_batch": 48, "train.grad_accum": 1,
                      "budget.checkpoints": "gpu"}),  # does not fit: GPU memory
])
def test_one_click_fix_makes_the_run_fit(qtbot, page, tmp_path, name, settings):
    model = published(tmp_path, name)
    show(qtbot, page, model, settings)
    before = page.plan.verdict
    assert before != "fits"
    fixes = page.plan.fixes
    buttons = page.fix_buttons()
    assert [b.text() for b in buttons] == [f.name for f in fixes]
    inputs = page.inputs.settings()  # a fix is clickable when the page has an input for it
    assert [b.isEnabled() for b in buttons] == [
        f.available and all(key in inputs for key, _ in f.settings) for f in fixes]
    for b, f in zip(buttons, fixes):  # e.g. "switch to qlora": chosen on the Train page
        if f.available and not b.isEnabled():
            assert b.toolTip() == "This page has no input for it"
    fix = fixes[0]  # the cheapest, which the planner says makes it fit
    assert fix.fits and buttons[0].objectName() == "primary"

    shown = page.plans_shown
    qtbot.mouseClick(buttons[0], Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.settled() and page.plans_shown > shown, timeout=10000)
    applied = page.inputs.settings()
    assert all(applied[key] == value for key, value in fix.settings)
    assert page.plan.verdict == reference(model, applied).verdict
    # A fix for a run that does not fit makes every budget hold; for a tight one, it leaves room.
    assert page.plan.verdict == "fits" if before == "tight" else page.plan.verdict != "does not fit"


def test_the_disk_fix_asks_for_a_folder_and_puts_moments_on_it(qtbot, page, tmp_path,
                                                               monkeypatch):
    model = published(tmp_path, "llama-3.1-8b")
    show(qtbot, page, model, {**DESKTOP, "budget.ram": "100GiB"})
    assert page.plan.verdict == "does not fit"
    fix = next(f for f in page.plan.fixes if f.name == "optimizer state on disk")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(nvme))
    shown = page.plans_shown
    qtbot.mouseClick(page.fix_buttons()[page.plan.fixes.index(fix)], Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.settled() and page.plans_shown > shown, timeout=10000)
    applied = page.inputs.settings()
    assert applied["budget.nvme_dir"] == str(nvme)
    assert applied["budget.nvme_size"] == dict(fix.settings)["budget.nvme_size"]
    ref = reference(model, applied)
    assert page.plan.verdict == ref.verdict != "does not fit" and ref.disk_layers > 0
    disk = next(r for r in page.memory.rows if r.key == "disk")
    assert [(s.key, s.value) for s in disk.segments] == [("NVMe tier", ref.tier("disk").peak)]


def test_find_max_batch_takes_the_largest_that_fits(qtbot, page, tmp_path):
    model = published(tmp_path, "llama-3.2-3b")
    show(qtbot, page, model, {"budget.vram": "24GiB", "budget.ram": "100GiB",
                              "data.max_seq_len": 1024, "train.micro_batch": 1,
                              "train.grad_accum": 2})
    largest = page.plan.max_micro_batch
    assert largest > 1 and page.inputs.max_button.isEnabled()
    qtbot.mouseClick(page.inputs.max_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.settled() and page.plan.exec_shape.micro_batch == largest)
    assert page.inputs.micro_batch.value() == largest
    assert page.plan.verdict != "does not fit" and not page.inputs.max_button.isEnabled()
    assert reference(model, page.inputs.settings()).verdict == page.plan.verdict


def test_quick_edits_end_on_the_plan_of_the_last_one(qtbot, page, tmp_path):
    show(qtbot, page, published(tmp_path, "llama-3.1-8b"), DESKTOP)
    shown = page.plans_shown
    for mb in range(2, 12):  # faster than the debounce: one plan at the end
        page.inputs.micro_batch.setValue(mb)
    qtbot.waitUntil(page.settled, timeout=10000)
    assert page.plan.exec_shape.micro_batch == 11
    assert page.plans_shown - shown <= 2


def test_every_settled_change_shows_its_own_plan(qtbot, page, tmp_path):
    """100 plans of an 8B model, each computed on the worker thread and shown. (How late the
    event loop runs meanwhile is measured by benchmarks/gui_latency.py.)"""
    show(qtbot, page, published(tmp_path, "llama-3.1-8b"), DESKTOP)
    page.debounce.setInterval(1)  # 100 plans without 100 pauses for typing
    shown = page.plans_shown
    for i in range(100):
        mb = 1 + (i + 1) % 8
        page.inputs.micro_batch.setValue(mb)
        qtbot.waitUntil(page.settled, timeout=10000)
        assert page.plan.exec_shape.micro_batch == mb
    assert page.plans_shown - shown == 100


def test_documentation_screenshots_render(qtbot, tmp_path):
    from PySide6.QtGui import QImage

    from tools.screenshots.plan import render
    paths = render(tmp_path / "shots")
    assert {p.name for p in paths} == {"plan-no-model.png", "plan-tight.png",
                                       "plan-does-not-fit.png", "plan-fits.png"}
    for p in paths:
        assert not QImage(str(p)).isNull()


def test_sequence_length_steps_by_powers_of_two(qtbot, page):
    box = page.inputs.seq_len
    box.setValue(3000)
    box.stepBy(1)
    assert box.value() == 4096
    box.stepBy(-2)
    assert box.value() == 1024
    box.stepBy(-20)
    assert box.value() == box.minimum()


def test_choosing_fp8_plans_fp8_projections(qtbot, page, tmp_path):
    """The precision choice is train.precision: FP8 shows in the run's description, its operand
    copies in the GPU bar's step scratch, and the plan is the planner's for the same inputs."""
    from slideformer.gui.pages.plan.rows import category
    model = published(tmp_path, "llama-3.1-8b")
    settings = {**DESKTOP, "train.method": "qlora", "train.precision": "fp8"}
    show(qtbot, page, model, settings)
    assert page.inputs.settings()["train.precision"] == "fp8"
    assert page.inputs.precision.currentText().startswith("FP8")
    ref = reference(model, settings)
    assert page.plan.speed == ref.speed and "FP8 projections" in page.shape.text()
    # a frozen base: the CPU updates nothing, the adapters are updated on the GPU
    assert "adapters updated on the GPU" in page.shape.text()
    assert "updates on the CPU" not in page.shape.text()
    assert category("FP8 operand copies") == "Step scratch"
    show(qtbot, page, model, {**settings, "train.precision": "bf16"})
    assert "FP8" not in page.shape.text()


def test_the_run_description_names_checkpoints_kept_on_the_gpu(qtbot, page, tmp_path):
    """An 8B full fine-tune at 64K tokens a step with 8-bit moments in 64 GiB of RAM: the plan
    keeps the top layers' checkpoints on the GPU, and the page says how many."""
    model = published(tmp_path, "llama-3.1-8b")
    settings = {**DESKTOP, "budget.ram": "64GiB", "data.max_seq_len": 1024,
                "train.micro_batch": 8, "train.grad_accum": 8, "optim.moments_dtype": "int8"}
    show(qtbot, page, model, settings)
    g = reference(model, settings).exec_shape.gpu_checkpoints
    assert g and page.plan.exec_shape.gpu_checkpoints == g
    assert f"the top {g} layers' on the GPU" in page.shape.text()


def test_the_speed_of_a_step_that_clips_is_shown_beside_the_plans(qtbot, page, tmp_path):
    """With exact clipping a step whose norm exceeds the limit runs without its speculative
    overlap: the speed line and the time estimate give that speed too (the planner's
    clipped_tokens_per_s); without clipping there is no such second speed."""
    model = published(tmp_path, "llama-3.2-3b")
    settings = {**DESKTOP, "data.max_seq_len": 1024, "train.micro_batch": 8,
                "train.grad_accum": 1, "optim.max_grad_norm": 1.0}
    show(qtbot, page, model, settings)
    ref = reference(model, settings)
    assert page.plan.clipped_tokens_per_s == ref.clipped_tokens_per_s
    assert ref.clipped_tokens_per_s < 0.98 * ref.speed.tokens_per_s
    assert f"{ref.clipped_tokens_per_s:,.0f} when a step clips" in page.speed.text()
    assert "if every step clips" in page.eta.text()
    show(qtbot, page, model, {**settings, "optim.max_grad_norm": 0.0})
    assert page.plan.clipped_tokens_per_s is None
    assert "clips" not in page.speed.text() and "clips" not in page.eta.text()
