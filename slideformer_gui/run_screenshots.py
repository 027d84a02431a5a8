"""Render the Data, Train and Runs pages during a real training run, for the documentation.

    python -m slideformer_gui.run_screenshots --out docs/screenshots

Offscreen, with throw-away settings and data folders. The run is real: the demo model and the
demo dataset (letter reversal), the "Demo" preset, on the CPU engine, so the charts show what a
user sees on any machine; the pictures are taken while it trains, then it is stopped and saved.
"""
from __future__ import annotations

import sys
from pathlib import Path

from slideformer_gui.main_window import MainWindow
from slideformer_gui.model_page import ensure_demo_model
from slideformer_gui.screenshots import (out_parser, print_paths, run_loop, save, studio_window,
                                         wait_until)

WINDOW_SIZE = (1560, 980)
STEPS_SHOWN = 70
"""The Train page is photographed once the run has made this many steps."""


def render(out: Path) -> list[Path]:
    """Write data-during-run.png, train-during-run.png and runs.png into ``out``."""
    with studio_window(out) as (window, _):
        try:
            return _shoot(window, out)
        finally:
            train = window.pages["Train"]
            if train.bridge is not None:
                train.bridge.abort()
                wait_until(lambda: train.bridge is None, 30000)


def _shoot(window: MainWindow, out: Path) -> list[Path]:
    written = []
    window.resize(*WINDOW_SIZE)
    window.monitor_dock.hide()  # the pages need the width; the Monitor has its own pictures
    window.show()
    ctx = window.ctx
    model = window.model_page
    model.load(ensure_demo_model(ctx.demo_model_dir))
    wait_until(lambda: ctx.model_path is not None)

    data = window.pages["Data"]
    window.show_page("Data")
    data.val_mode.setCurrentIndex(data.val_mode.findData("fraction"))
    data.use_demo()
    wait_until(lambda: data.report is not None, 60000)

    train = window.pages["Train"]
    window.show_page("Train")
    preset = next(p for p in train.settings.presets if p.name.startswith("Demo"))
    train.settings.apply_preset(preset)
    train.settings.device.setCurrentIndex(train.settings.device.findData("cpu"))
    wait_until(lambda: data.report is not None and data.report.cfg == ctx.data_config, 60000)
    train.start()
    wait_until(lambda: train.dashboard.history.last is not None
               and train.dashboard.history.last.step >= STEPS_SHOWN and len(train.dashboard.history.val_steps) >= 2,
               300000)
    run_loop(600)
    train.dashboard.repaint_all()
    written.append(save(window, out / "train-during-run.png"))

    window.show_page("Data")
    written.append(save(window, out / "data-during-run.png"))

    runs = window.pages["Runs"]
    window.show_page("Runs")
    wait_until(lambda: runs.select(train.run_dir))
    written.append(save(window, out / "runs.png"))

    window.show_page("Train")
    train.stop_and_save()
    wait_until(lambda: train.bridge is None, 120000)
    return written


def main(argv: list[str] | None = None) -> int:
    return print_paths(render(out_parser(__doc__).parse_args(argv).out))


if __name__ == "__main__":
    sys.exit(main())
