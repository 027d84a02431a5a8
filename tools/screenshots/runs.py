"""Take every page's picture, light and dark, during a real training run, for the documentation.

    xvfb-run -s "-screen 0 1366x768x24" python -m tools.screenshots.runs --out docs/screenshots

A real X window (xcb) at 1366x768 with the Monitor showing this machine, throw-away settings and
data folders. The run is real: the demo model and the demo dataset (letter reversal), the plan
of the Plan page ("Use this plan") with the "Demo" preset's length, on the CPU engine; the
pictures are taken while it trains, then it is stopped and saved.
"""
from __future__ import annotations

import sys
from pathlib import Path

from slideformer.gui.main_window import MainWindow
from slideformer.gui.pages.model import ensure_demo_model
from slideformer.gui.capture import (WINDOW_SIZE, out_parser, print_paths, run_loop, save,
                                         studio_window, use_x_server, wait_until)

STEPS_SHOWN = 10
"""The Train page is photographed once the run has made this many steps."""


def render(out: Path) -> list[Path]:
    """Write ``<page>-light.png`` and ``<page>-dark.png`` of every page into ``out``."""
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
    plan = window.pages["Plan"]
    window.show_page("Plan")
    cfg = train.settings.config()
    plan.inputs.apply({"train.micro_batch": cfg.train.micro_batch,
                       "train.grad_accum": cfg.train.grad_accum,
                       "optim.max_grad_norm": cfg.optim.max_grad_norm})
    wait_until(lambda: plan.plan is not None and plan.settled(), 120000)
    plan.use_plan()  # the run takes the plan's shape and budgets, the Train page its forecast
    train.settings.device.setCurrentIndex(train.settings.device.findData("cpu"))
    train.start()
    wait_until(lambda: train.dashboard.history.last is not None
               and train.dashboard.history.last.step >= STEPS_SHOWN,
               900000)
    runs = window.pages["Runs"]
    window.show_page("Runs")  # the page scans its folder when shown
    wait_until(lambda: runs.select(train.run_dir), 180000)
    for theme in ("light", "dark"):
        window.set_theme(theme)
        for title in window.pages:
            window.show_page(title)
            run_loop(600)
            train.dashboard.repaint_all()
            written.append(save(window, out / f"{title.lower()}-{theme}.png"))
    window.set_theme("light")

    window.show_page("Train")
    train.stop_and_save()
    wait_until(lambda: train.bridge is None, 120000)
    return written


def main(argv: list[str] | None = None) -> int:
    args = out_parser(__doc__).parse_args(argv)
    use_x_server()
    return print_paths(render(args.out))


if __name__ == "__main__":
    sys.exit(main())
