"""Small things a person notices: empty charts, the time left of a stopped run, one byte
format, what tells runs apart, and a folder that another process trains."""
import sys
import textwrap
import subprocess

from slideformer.engine import config as config_mod
from slideformer.engine.config import format_bytes
from slideformer.engine.events import StepMetrics
from slideformer.gui.models.formatting import human_bytes
from slideformer.gui.models.runs import summarize
from slideformer.gui.models.metrics import StepHistory, progress
from slideformer.gui.widgets.plots import METRICS, MetricPlot


def _step(n, total=100):
    return StepMetrics(step=n, total_steps=total, loss=2.0, lr=1e-4, grad_norm=1.0, tokens=10,
                       tokens_per_s=100.0, step_time=2.0, peak_vram=None, peak_ram=1 << 30)


def test_an_empty_chart_waits_for_the_first_step_and_names_its_unit(qtbot):
    plot = MetricPlot(METRICS["memory"])
    qtbot.addWidget(plot)
    plot.show()
    history = StepHistory()
    plot.repaint_from(history)
    assert plot.waiting.isVisible() and not plot.plot.isVisible()
    assert plot.plot.getPlotItem().getAxis("left").labelText == "GiB"
    history.add(_step(1))
    plot.repaint_from(history)
    assert plot.plot.isVisible() and not plot.waiting.isVisible()
    assert "VRAM" not in plot.value.text() and "RAM 1.00" in plot.value.text()  # no "n/a" noise


def test_the_time_left_goes_when_the_run_stops():
    history = StepHistory()
    for n in (1, 2, 3):
        history.add(_step(n))
    assert "left" in progress(history, running=True).text
    assert "left" not in progress(history, running=False).text


def test_one_byte_format():
    assert human_bytes is format_bytes
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**40) == "3.0 TiB"


def test_the_runs_table_tells_runs_apart_and_sees_the_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = config_mod.override(config_mod.RunConfig(), {"train.micro_batch": 4,
                                                       "train.grad_accum": 8,
                                                       "data.max_seq_len": 512, "optim.lr": 2e-5})
    (run / "config.toml").write_text(config_mod.dumps(cfg))
    assert summarize(run).settings == "4 x 8 x 512 tokens, lr 2e-05"
    assert not summarize(run).live
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from slideformer.engine.train.lock import RunLock
        RunLock({str(run)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert summarize(run).live  # the lock says a process trains it
    finally:
        holder.kill()
        holder.wait()
    assert not summarize(run).live
