"""Point-and-click fine-tuning end to end: real engine processes on the CPU, a tiny model, the
demo task. Covers start / pause / resume / stop-and-save, an engine killed with SIGKILL and its
resume from the Runs page, and a terminal run followed live (how late the GUI thread runs
meanwhile is measured by benchmarks/gui_latency.py, not asserted here).
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from slideformer.engine import config as config_mod
from slideformer.engine.events import RunState, StepMetrics, read_events
from slideformer.gui.app import freeze_heap

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

RUN_SETTINGS = dict(max_steps=40, micro_batch=4, grad_accum=2, seq_len=64, lr=3e-3,
                    save_every=5, eval_every=10)


@pytest.fixture(autouse=True)
def _never_ask(monkeypatch):
    """A test that fails mid-run must not hang on the close question: abort the engine."""
    from slideformer.gui.pages.train.page import TrainPage
    monkeypatch.setattr(TrainPage, "ask_close", lambda self: "abort")


def choose_model_and_demo_data(qtbot, window, model_dir):
    window.show_page("Model")
    with qtbot.waitSignal(window.model_page.model_selected, timeout=20000):
        window.model_page.load(str(model_dir))
    window.show_page("Data")
    data = window.pages["Data"]
    data.val_mode.setCurrentIndex(data.val_mode.findData("fraction"))
    with qtbot.waitSignal(data.analysed, timeout=30000) as got:
        qtbot.mouseClick(data.demo_button, Qt.MouseButton.LeftButton)
    return data, got.args[0]


def fill_settings(page, max_steps, micro_batch, grad_accum, seq_len, lr, save_every,
                  eval_every):
    s = page.settings
    s.max_steps.setValue(max_steps)
    s.micro_batch.setValue(micro_batch)
    s.grad_accum.setValue(grad_accum)
    s.seq_len.setValue(seq_len)
    s.lr.setValue(lr)
    s.warmup.setValue(0)
    s.save_every.setValue(save_every)
    s.eval_every.setValue(eval_every)
    s.device.setCurrentIndex(s.device.findData("cpu"))


def step_losses(run_dir):
    last = {}
    for ev in read_events(Path(run_dir) / "events.jsonl"):
        if isinstance(ev, StepMetrics) and ev.loss is not None:
            last[ev.step] = ev.loss
    return [last[k] for k in sorted(last)]


def points(page, name="loss", curve=0):
    x, _ = page.dashboard.plots[name].curves[curve].getData()
    return 0 if x is None else len(x)


def test_point_and_click_run_pause_resume_stop_and_save(qtbot, window, tiny_llama):
    transformers = pytest.importorskip("transformers")
    data, report = choose_model_and_demo_data(qtbot, window, tiny_llama)
    assert report.stats.format == "messages" and report.stats.val_records > 0
    assert any(trained for sample in report.preview.samples for _, trained in sample.pieces)
    _, heights = data.histogram.bars.opts["x0"], data.histogram.bars.opts["height"]
    assert sum(heights) == report.stats.records

    window.show_page("Train")
    page = window.pages["Train"]
    fill_settings(page, **RUN_SETTINGS)
    assert window.ctx.data_config.max_seq_len == 64  # the sequence length is shared
    freeze_heap()

    qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    run_dir = page.run_dir
    qtbot.waitUntil(lambda: points(page) >= 2, timeout=60000)
    qtbot.mouseClick(page.pause_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.phase == "paused", timeout=20000)
    paused_at = page.dashboard.history.last.step
    qtbot.wait(600)
    assert page.dashboard.history.last.step == paused_at  # really paused
    assert page.pause_button.text() == "Resume"
    qtbot.mouseClick(page.pause_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.dashboard.history.last.step > paused_at, timeout=20000)
    qtbot.mouseClick(page.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.end is not None, timeout=60000)

    assert page.end.outcome == "stopped", page.end
    assert page.dashboard.status.property("state") == "ok"
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "memory"):
        assert points(page, name) >= 3, name
    assert page.dashboard.timeline.step is not None and page.dashboard.timeline.bars.opts["x0"]

    losses = step_losses(run_dir)
    assert 3 <= len(losses) < RUN_SETTINGS["max_steps"]
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.5  # the loss fell
    states = [ev.state for ev in read_events(run_dir / "events.jsonl")
              if isinstance(ev, RunState)]
    assert "paused" in states and states[-1] == "stopped"
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.num_hidden_layers == 4
    # The config the app wrote is the one the run used, and the terminal command names it.
    saved = config_mod.load(run_dir / "config.toml")
    assert saved.train.micro_batch == 4 and saved.data.max_seq_len == 64
    assert saved.train.device == "cpu" and saved.data.train.endswith("reverse-letters.jsonl")
    dialog = page.show_command()
    assert dialog.command.text().startswith("slideformer train --config ")
    dialog.close()


def test_engine_killed_mid_run_then_resumed_from_the_runs_page(qtbot, window, tiny_llama):
    choose_model_and_demo_data(qtbot, window, tiny_llama)
    window.show_page("Train")
    page = window.pages["Train"]
    fill_settings(page, **RUN_SETTINGS)
    qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    run_dir = page.run_dir
    qtbot.waitUntil(lambda: (run_dir / "checkpoints" / "step-5").is_dir(),
                    timeout=60000)
    pid = page.bridge.pid
    os.kill(pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: page.end is not None, timeout=20000)

    assert page.end.outcome == "failed"
    assert page.dashboard.status.property("state") == "error"
    assert "SIGKILL" in page.dashboard.status.text() and "checkpoint at step" in page.dashboard.status.text()
    assert page.dashboard.failure_log.isVisible() and "step" in page.dashboard.failure_log.toPlainText()
    assert page.resume_button.isVisible() and page.start_button.isEnabled()  # still usable
    killed_at = page.dashboard.history.last.step

    window.show_page("Runs")
    runs = window.pages["Runs"]
    qtbot.waitUntil(lambda: runs.select(run_dir), timeout=10000)
    summary = runs.selected()
    assert summary.status == "interrupted" and summary.resumable
    assert runs.resume_button.isEnabled()
    qtbot.mouseClick(runs.resume_button, Qt.MouseButton.LeftButton)
    assert window.stack.currentWidget() is page
    qtbot.waitUntil(lambda: page.end is not None and page.bridge is None, timeout=90000)

    assert page.end.outcome == "finished", page.end
    events = read_events(run_dir / "events.jsonl")
    resumed = [i for i, ev in enumerate(events) if getattr(ev, "message", "").startswith(
        "resumed from step-")]
    assert resumed
    checkpoint = int(events[resumed[-1]].message.rsplit("-", 1)[1])
    assert checkpoint <= killed_at
    after = [ev.step for ev in events[resumed[-1]:] if isinstance(ev, StepMetrics)]
    assert after[0] == checkpoint + 1 and after[-1] == RUN_SETTINGS["max_steps"]
    # The plots show the run as the model followed it: one point per step, no repeats.
    steps = list(page.dashboard.history.column("step"))
    assert steps == sorted(set(steps)) and steps[-1] == RUN_SETTINGS["max_steps"]
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_a_terminal_run_is_followed_live_and_stopped_from_the_app(qtbot, window, tiny_llama,
                                                                 tmp_path):
    from slideformer.engine.train.demo import write_task
    write_task(tmp_path / "task.jsonl", 300, seed=3)
    run_dir = window.ctx.runs_dir / "from-terminal"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "slideformer.engine.cli", "train", "--model", str(tiny_llama),
         "--data", str(tmp_path / "task.jsonl"), "--run-dir", str(run_dir),
         "--max-steps", "400", "--micro-batch", "4", "--seq-len", "64", "--lr", "3e-3",
         "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        window.show_page("Runs")
        runs = window.pages["Runs"]
        qtbot.waitUntil(lambda: runs.select(run_dir) and runs.selected().live, timeout=60000)
        assert runs.show_button.text() == "Follow live"
        qtbot.mouseClick(runs.show_button, Qt.MouseButton.LeftButton)
        page = window.pages["Train"]
        assert window.stack.currentWidget() is page
        qtbot.waitUntil(lambda: page.dashboard.history.last is not None, timeout=30000)
        seen = page.dashboard.history.last.step
        qtbot.waitUntil(lambda: page.dashboard.history.last.step >= seen + 3, timeout=30000)  # live
        assert page.detach_button.isVisible()
        qtbot.mouseClick(page.stop_button, Qt.MouseButton.LeftButton)  # through the run folder
        # a hang guard, generous for a busy 2-core machine (the export of a tiny model); not a speed check
        assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
        qtbot.waitUntil(lambda: page.end is not None, timeout=20000)
        assert page.end.outcome == "stopped"
        assert (run_dir / "final" / "config.json").is_file()
        assert page.dashboard.history.last.step < 400
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_closing_the_app_can_leave_a_run_training_and_a_new_window_follows_it(
        qtbot, window, tiny_llama, ctx, monkeypatch):
    from slideformer.gui.main_window import MainWindow
    from slideformer.gui.pages.train.page import TrainPage
    from slideformer.engine.train.control import engine_alive
    choose_model_and_demo_data(qtbot, window, tiny_llama)
    page = window.pages["Train"]
    fill_settings(page, **dict(RUN_SETTINGS, max_steps=400, save_every=0, eval_every=0))
    qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    run_dir = page.run_dir
    qtbot.waitUntil(lambda: page.dashboard.history.last is not None, timeout=60000)
    pid = page.bridge.pid
    monkeypatch.setattr(TrainPage, "ask_close", lambda self: "background")
    assert window.close()
    try:
        assert engine_alive(run_dir) == pid  # it trains on without the app
        again = MainWindow(ctx)
        qtbot.addWidget(again)
        again.show()
        runs = again.pages["Runs"]
        qtbot.waitUntil(lambda: runs.select(run_dir) and runs.selected().live, timeout=20000)
        qtbot.mouseClick(runs.show_button, Qt.MouseButton.LeftButton)
        follow = again.pages["Train"]
        qtbot.waitUntil(lambda: follow.phase == "running" and follow.dashboard.history.last is not None,
                        timeout=20000)
        qtbot.mouseClick(follow.stop_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: follow.end is not None, timeout=60000)
        assert follow.end.outcome == "stopped"
        assert (run_dir / "final" / "config.json").is_file()
    finally:
        if engine_alive(run_dir) is not None:
            os.kill(pid, signal.SIGKILL)
