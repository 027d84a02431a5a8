"""The Train page, the Runs page's files and the presets against recorded event streams and run
folders: no engine process runs here."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from slideformer.engine import config as config_mod
from slideformer.engine.api import EventReader
from slideformer.engine.events import (CheckpointSaved, EvalMetrics, Log, RunState, Span, StepMetrics,
                           Timeline, to_json)
from slideformer.engine.train.control import CONTROL_FILE
from slideformer.gui.pages.train import dashboard as train_dashboard
from slideformer.gui.models.presets import apply_preset, load_presets
from slideformer.gui.models.runs import scan_runs, summarize
from slideformer.gui.models.metrics import StepHistory, stall_seconds
from slideformer.gui.pages.train.page import TrainPage

LAYERS = ("embed", "layer0", "layer1", "head")


def step(n, total=40, loss=None, step_time=0.5):
    return StepMetrics(step=n, total_steps=total, loss=5.0 - 0.1 * n if loss is None else loss,
                       lr=1e-3, grad_norm=1.0 + n / 100, tokens=100, tokens_per_s=2000.0,
                       step_time=step_time, peak_vram=None, peak_ram=300 << 20, time=1000.0 + n)


def timeline(n):
    spans, t = [], 0.0
    for lane in ("h2d", "compute", "d2h", "optimizer"):
        for item in LAYERS:
            spans.append(Span(lane, item, t, t + 0.01))
            t += 0.01
    return Timeline(n, tuple(spans), time=1000.0 + n)


def recorded_run(steps=20, total=40):
    events = [RunState("setup", "loading model and data", time=999.0),
              RunState("running", time=999.5)]
    for n in range(1, steps + 1):
        events.append(step(n, total))
        if n > 1:
            events.append(timeline(n - 1))
        if n % 10 == 0:
            events.append(CheckpointSaved(n, f"checkpoints/step-{n}", time=1000.0 + n))
            events.append(EvalMetrics(n, 4.0 - n * 0.05, time=1000.0 + n))
    events.append(Log("warning", "the planner predicts this run is tight", time=1000.0 + steps))
    return events


@pytest.fixture
def page(qtbot, ctx, tmp_path):
    p = TrainPage(ctx)
    qtbot.addWidget(p)
    p.show()
    p.run_dir = tmp_path / "run"  # what a bridge would be following
    p.dashboard.reset(p.run_dir)
    return p


def test_a_recorded_run_fills_every_chart_the_timeline_and_the_progress(qtbot, page):
    page._on_events(recorded_run())
    page.dashboard.repaint_all()
    x, y = page.dashboard.plots["loss"].curves[0].getData()
    assert list(x) == list(range(1, 21)) and y[-1] == pytest.approx(3.0)
    vx, vy = page.dashboard.plots["loss"].curves[2].getData()
    assert list(vx) == [10, 20] and vy[-1] == pytest.approx(3.0)
    smooth = page.dashboard.plots["loss"].curves[1].getData()[1]
    assert smooth[-1] > y[-1]  # the moving average lags a falling loss
    assert "validation 3.000" in page.dashboard.plots["loss"].value.text()
    assert "step 20 / 40" in page.dashboard.progress_text.text() and "10 s left" in page.dashboard.progress_text.text()
    assert page.dashboard.progress_bar.value() == 500
    assert page.dashboard.timeline.step == 19
    ticks = page.dashboard.timeline.plot.getPlotItem().getAxis("left")._tickLevels[0]
    assert [t[1].split()[0] for t in ticks] == ["compute", "upload", "download", "CPU"]
    log = page.dashboard.log_view.toPlainText()
    assert "checkpoint saved at step 20" in log and "warning: the planner predicts" in log
    assert page.phase == "running"


def test_a_resumed_run_replaces_the_steps_it_repeats(qtbot, page):
    page._on_events(recorded_run(steps=17))
    resumed = [RunState("setup", time=2000.0), Log("info", "resumed from step-10", time=2000.0),
               RunState("running", step=10, time=2000.0)] + [step(n, loss=1.0) for n in (11, 12)]
    page._on_events(resumed)
    page.dashboard.repaint_all()
    x, y = page.dashboard.plots["loss"].curves[0].getData()
    assert list(x) == list(range(1, 13)) and list(y[-2:]) == [1.0, 1.0]
    assert list(page.dashboard.plots["loss"].curves[2].getData()[0]) == [10]


def test_a_preference_run_shows_its_rewards_in_place_of_the_learning_rate(qtbot, page):
    from slideformer.engine.events import PairMetrics
    pairs = [PairMetrics(n, 0.5 + n / 100, 0.01 * n, -0.02 * n, 0.03 * n, time=1000.0 + n)
             for n in range(1, 21)]
    events = recorded_run()
    page._on_events([e for ev in events for e in
                     ([ev] + [pairs[ev.step - 1]] if isinstance(ev, StepMetrics) else [ev])])
    page.dashboard.repaint_all()
    assert page.dashboard.corner.currentWidget() is page.dashboard.plots["rewards"]
    x, margin = page.dashboard.plots["rewards"].curves[2].getData()
    assert list(x) == list(range(1, 21)) and list(margin) == pytest.approx([p.margin for p in pairs])
    assert "margin 0.60" in page.dashboard.plots["rewards"].value.text()
    page.dashboard.reset(page.run_dir)  # a supervised run next: the learning rate again
    page._on_events(recorded_run(steps=3))
    assert page.dashboard.corner.currentWidget() is page.dashboard.plots["lr"]


def test_a_grpo_run_shows_its_mean_reward_in_place_of_the_learning_rate(qtbot, page):
    from slideformer.engine.events import RolloutMetrics
    rolls = [RolloutMetrics(n, 0.02 * n, 0.1, 8.0, 0.05, time=1000.0 + n) for n in range(1, 21)]
    events = recorded_run()
    page._on_events([e for ev in events for e in
                     ([ev] + [rolls[ev.step - 1]] if isinstance(ev, StepMetrics) else [ev])])
    page.dashboard.repaint_all()
    assert page.dashboard.corner.currentWidget() is page.dashboard.plots["reward"]
    x, mean = page.dashboard.plots["reward"].curves[0].getData()
    assert list(x) == list(range(1, 21)) and list(mean) == pytest.approx([r.reward_mean for r in rolls])
    assert "0.400" in page.dashboard.plots["reward"].value.text()


def test_history_keeps_a_long_run_by_halving_and_restarts_after_a_rewind():
    h = StepHistory(capacity=16)
    for n in range(1, 101):
        h.add(step(n, total=100))
    steps = h.column("step")
    assert len(steps) <= 16 and steps[0] <= 8 and steps[-1] >= 96  # the whole run, coarser
    assert np.all(np.diff(steps) > 0)
    h.add(step(50, total=100, loss=0.0))
    assert h.column("step")[-1] <= 50 and h.last.step == 50


def test_a_stall_is_shown_after_ten_usual_steps_without_news(qtbot, page, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(train_dashboard, "now", lambda: clock[0])
    page._on_events(recorded_run(steps=5))
    page.dashboard.check_stall()
    assert page.dashboard.stall.isHidden()
    clock[0] += 29.0  # 10 x 0.5 s has passed, but less than the 30 s floor
    page.dashboard.check_stall()
    assert page.dashboard.stall.isHidden()
    clock[0] += 2.0
    page.dashboard.check_stall()
    assert page.dashboard.stall.isVisible() and "No progress for 31 s" in page.dashboard.stall.text()
    page._on_events([step(6)])
    page.dashboard.check_stall()
    assert page.dashboard.stall.isHidden()
    assert stall_seconds(StepHistory(), 1e6) is None  # no step yet: setup can take long


def test_closing_with_a_run_in_progress_asks_and_does_what_was_chosen(qtbot, page, monkeypatch):
    class FakeBridge:
        owned = True

        def __init__(self):
            self.calls = []
            self.ended = type("S", (), {"disconnect": lambda *a: None})()

        def __getattr__(self, name):
            return lambda *a: self.calls.append(name)

    for choice, expected in ((None, []), ("stop", ["stop_and_save", "detach", "wait"]),
                             ("background", ["detach", "wait"]),
                             ("abort", ["abort", "detach", "wait"])):
        bridge = FakeBridge()
        page.bridge, page.phase = bridge, "running"
        monkeypatch.setattr(TrainPage, "ask_close", lambda self, c=choice: c)
        assert page.confirm_close() is (choice is not None)
        assert bridge.calls == expected
    page.bridge = None


def test_every_preset_maps_onto_the_run_config():
    presets = load_presets()
    assert {p.name for p in presets} >= {"Quick test", "Chat fine-tune", "Demo (letter reversal)",
                                         "Large model on a 24 GB GPU"}
    for p in presets:
        cfg = apply_preset(config_mod.RunConfig(), p)
        for section, table in p.values.items():
            for key, value in table.items():
                assert getattr(getattr(cfg, section), key) == value
        assert p.description and not p.description[0].islower()


def test_run_folders_are_summarised_from_their_files(tmp_path):
    def write_run(name, events, control=None):
        d = tmp_path / name
        d.mkdir()
        (d / "events.jsonl").write_text("".join(to_json(e) + "\n" for e in events))
        cfg = config_mod.override(config_mod.RunConfig(), {"model.path": "/m/tiny",
                                                            "data.train": "/d/x.jsonl"})
        (d / "config.toml").write_text(config_mod.dumps(cfg))
        if control is not None:
            (d / CONTROL_FILE).write_text(control)
        return d

    write_run("done", recorded_run(4, 4) + [RunState("finished", "model saved", 4)])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = write_run("killed", recorded_run(6), f"# engine pid={dead.pid} started=1.0\n")
    (killed / "checkpoints" / "step-5").mkdir(parents=True)
    me = __import__("psutil").Process()
    live = write_run("live", recorded_run(3),
                     f"# engine pid={os.getpid()} started={me.create_time():.3f}\n")
    by_name = {s.name: s for s in scan_runs([tmp_path])}
    assert set(by_name) == {"done", "killed", "live"}
    assert by_name["done"].status == "finished" and not by_name["done"].resumable
    k = by_name["killed"]
    assert k.status == "interrupted" and k.checkpoint == 5 and k.resumable and k.step == 6
    assert k.model == "/m/tiny" and k.loss == pytest.approx(4.4)
    assert by_name["live"].live and by_name["live"].status == "running"
    assert summarize(live).total_steps == 40


def test_event_reader_waits_for_the_end_of_a_line(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read_new() == []
    line = to_json(step(1))
    path.write_text(line[:20])
    assert reader.read_new() == []
    with open(path, "a") as f:
        f.write(line[20:] + "\n" + json.dumps({"kind": "Log", "level": "info", "message": "x",
                                               "time": 1.0}) + "\n")
    assert [type(e).__name__ for e in reader.read_new()] == ["StepMetrics", "Log"]
