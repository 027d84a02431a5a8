"""The Runs page compares chosen runs: their loss curves overlaid and the settings they differ
in, read from real run folders (two short CPU runs of the tiny model)."""
from __future__ import annotations

import pytest

from slideformer.engine.events import EvalMetrics, StepMetrics, read_events
from slideformer.engine.train.commands import run_training
from slideformer.gui.models.compare import compare, config_differences, read_curve


@pytest.fixture(scope="module")
def two_runs(tiny_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    runs = []
    for name, lr in (("lr-2e-3", 2e-3), ("lr-5e-3", 5e-3)):
        cfg = tiny_run(root / name, {"optim.lr": lr, "train.max_steps": 4, "train.eval_every": 2},
                       validation=8)
        assert run_training(cfg) == "finished"
        runs.append(root / name)
    return runs


def test_curves_are_the_losses_of_events_jsonl(two_runs):
    for run in two_runs:
        curve = read_curve(run)
        evs = read_events(run / "events.jsonl")
        assert list(curve.losses) == [e.loss for e in evs if isinstance(e, StepMetrics)]
        assert list(curve.val_steps) == [e.step for e in evs if isinstance(e, EvalMetrics)]
        assert curve.steps == (1, 2, 3, 4) and curve.name == run.name


def test_differences_are_the_keys_that_differ(two_runs):
    rows = dict(config_differences(two_runs))
    assert rows.pop("optim.lr") == ["0.002", "0.005"]
    assert rows.pop("output.run_dir") == [str(r) for r in two_runs]
    assert rows == {}
    assert config_differences([two_runs[0], two_runs[0].parent / "missing"])[0][1][1] == "?"


def test_choosing_two_runs_shows_them_compared(qtbot, ctx, two_runs):
    from slideformer.gui.pages.runs import RunsPage
    ctx.settings.add_extra_run(str(two_runs[0]))
    ctx.settings.add_extra_run(str(two_runs[1]))
    page = RunsPage(ctx)
    qtbot.addWidget(page)
    page.show()
    qtbot.waitUntil(lambda: page.table.topLevelItemCount() == 2, timeout=20000)
    page.table.selectAll()
    qtbot.waitUntil(lambda: page.compare_view.differences.topLevelItemCount() == 2, timeout=20000)
    assert page.detail_pages.currentIndex() == 1 and page.details.title() == "2 runs compared"
    assert not page.resume_button.isEnabled() and not page.export_button.isEnabled()
    plotted = [c for c in page.compare_view.plot.getPlotItem().listDataItems()]
    assert len(plotted) == 4  # training and validation of each run
    expected = compare([str(p) for p in two_runs])[0]
    trains = sorted(tuple(d.yData) for d in plotted if d.name())
    assert trains == sorted(c.losses for c in expected)
    page.select(two_runs[0])
    assert page.detail_pages.currentIndex() == 0
