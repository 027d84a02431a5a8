"""``slideformer gui --self-test``: check that this installation works, without a display.

Imports the engine and the app, creates a tiny model and a small data set in a temporary
folder, trains 3 steps on the CPU, then opens the main window offscreen with that model chosen
(so the Plan page asks its planner process) and renders every page to a PNG. Prints one line
per check and returns 0, or names the check that failed and returns 1. The user's settings and
data folder are not touched. Meant for a freshly installed desktop bundle (see
``build_installer.py --smoke``) as much as for a source checkout.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from slideformer.engine.api import UserError

TRAIN_STEPS = 3


class _Report:
    def __init__(self):
        self.t0 = time.monotonic()

    def ok(self, what: str) -> None:
        print(f"  ok   {what}  ({time.monotonic() - self.t0:.1f} s)", flush=True)


def _imports(report: _Report) -> None:
    import numpy  # noqa: F401
    import safetensors  # noqa: F401
    import tokenizers  # noqa: F401
    import torch
    from PySide6 import __version__ as qt_version

    from slideformer.engine.api import __version__
    report.ok(f"imports: slideformer {__version__}, torch {torch.__version__}, "
              f"PySide6 {qt_version}")


def _train(root: Path, report: _Report) -> Path:
    from slideformer.engine.api import TinyShape, config_from_dict, make_tiny_model, run_training, write_task

    model = make_tiny_model(root / "model", "qwen2", TinyShape(layers=2, tie=True), seed=0)
    write_task(root / "train.jsonl", 40, 1)
    write_task(root / "val.jsonl", 8, 2)
    report.ok(f"tiny model and data set in {root.name}")
    run_dir = root / "run"
    cfg = config_from_dict({
        "model": {"path": str(model)},
        "data": {"train": str(root / "train.jsonl"), "validation": str(root / "val.jsonl"),
                 "max_seq_len": 64},
        "optim": {"lr": 2e-3, "warmup_steps": 1},
        "train": {"micro_batch": 2, "grad_accum": 1, "max_steps": TRAIN_STEPS, "device": "cpu"},
        "budget": {"slots": 2},
        "output": {"run_dir": str(run_dir)}})
    run_training(cfg)
    if not (run_dir / "final" / "model.safetensors").is_file():
        raise RuntimeError(f"training finished without writing {run_dir / 'final'}")
    report.ok(f"trained {TRAIN_STEPS} steps on the CPU")
    return model


def _render(model: Path, out: Path, report: _Report) -> list[Path]:
    from slideformer.gui.main_window import PAGES
    from slideformer.gui.capture import WINDOW_SIZE, run_loop, studio_window, wait_until

    written = []
    with studio_window(out) as (window, _tmp):
        window.resize(*WINDOW_SIZE)
        window.show()
        page = window.model_page
        page.load(str(model))
        wait_until(lambda: page.status.property("state") in ("ok", "error"), 60000)
        if page.status.property("state") != "ok":
            raise RuntimeError(f"the Model page rejected the tiny model: {page.status.text()}")
        report.ok("Model page checked the tiny model")
        plan = window.pages["Plan"]
        wait_until(plan.settled, 120000)  # the planner runs in a spawned child process
        report.ok("Plan page answered (planner process)")
        for row, (title, _icon, _cls) in enumerate(PAGES):
            window.sidebar.setCurrentRow(row)
            run_loop(100)
            path = out / f"page-{row + 1}-{title.lower()}.png"
            if not window.grab().save(str(path)) or path.stat().st_size == 0:
                raise RuntimeError(f"could not render the {title} page to {path}")
            written.append(path)
        report.ok(f"rendered {len(written)} pages: {', '.join(t for t, _i, _c in PAGES)}")
    return written


def _platform(platform: str | None, report: _Report) -> None:
    """Choose the Qt platform before Qt starts, and check its system libraries."""
    if platform is None:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        return
    if platform != "native":
        os.environ["QT_QPA_PLATFORM"] = platform
    else:
        os.environ.pop("QT_QPA_PLATFORM", None)
    from slideformer.gui.platform_check import check_platform, platform_name
    check_platform()
    report.ok(f"Qt platform {platform_name()}: its system libraries are here")


def run_self_test(platform: str | None = None) -> int:
    """Run every check; 0 when all pass, 1 (with the failing check named) otherwise.

    Args:
        platform: the Qt platform to open the window on (``native``: the session's); None
            renders offscreen, which needs no display and no X libraries.
    """
    report = _Report()
    print("SlideFormer Studio self-test", flush=True)
    step = "the Qt platform"
    try:
        _platform(platform, report)
        step = "imports"
        _imports(report)
        with tempfile.TemporaryDirectory(prefix="slideformer-self-test-") as tmp:
            root = Path(tmp)
            step = "training"
            model = _train(root, report)
            step = "rendering the pages"
            _render(model, root / "pages", report)
    except UserError as e:  # a missing system library: what to install, no traceback
        print(f"self-test FAILED at {step}: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - the report is the product here
        traceback.print_exc()
        print(f"self-test FAILED at {step}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"self-test passed in {time.monotonic() - report.t0:.1f} s", flush=True)
    return 0
