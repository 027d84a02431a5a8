"""Lay the main window out at 1366x768 on a real X server and list what does not fit.

Run as a child process by test_gui_geometry.py (``DISPLAY`` set, the xcb platform):
``python tests/gui/geometry_probe.py OUT.json``. For every page, in both themes, with a model
chosen, two runs listed and the Monitor visible (then folded to its strip), it writes the
problems it finds:

- a widget that reaches outside the window, or outside its parent (a clipped box);
- a label narrower than its one-line text, or shorter than its wrapped text;
- a scroll area that never scrolls sideways but whose content is wider than it;
- a column of the Runs table cut off by the table, or narrower than its title;
- a Monitor that does not fold to its narrow strip, or does not unfold to its width.

Content inside a scroll area is clipped by design (it scrolls); pyqtgraph's views are drawn,
not laid out, and are left out.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["QT_QPA_PLATFORM"] = "xcb"

from PySide6.QtCore import QPoint, QRect, QSettings, Qt  # noqa: E402
from PySide6.QtWidgets import QAbstractScrollArea, QGraphicsView, QLabel, QWidget  # noqa: E402

SIZE = (1366, 768)


def _inside_scrolled(w: QWidget) -> bool:
    """``w`` lives in a scroll area's viewport (or is drawn by a graphics view)."""
    p = w.parentWidget()
    while p is not None:
        if isinstance(p, QGraphicsView):
            return True
        if isinstance(p.parentWidget(), QAbstractScrollArea) and p is p.parentWidget().viewport():
            return True
        p = p.parentWidget()
    return False


def problems(window: QWidget, where: str) -> list[str]:
    found = []
    frame = window.rect()
    for w in window.findChildren(QWidget):
        if not w.isVisibleTo(window) or w.isWindow() or _inside_scrolled(w) \
                or isinstance(w.parentWidget(), QGraphicsView):
            continue
        name = f"{where}: {type(w).__name__} {w.objectName() or ''}".rstrip()
        r = QRect(w.mapTo(window, QPoint(0, 0)), w.size())
        if not frame.contains(r):
            found.append(f"{name} {r.getRect()} is outside the window {frame.getRect()}")
        elif w.parentWidget() is not None and not w.parentWidget().rect().contains(w.geometry()):
            found.append(f"{name} {w.geometry().getRect()} is clipped by its parent "
                         f"{type(w.parentWidget()).__name__} {w.parentWidget().rect().getRect()}")
        if isinstance(w, QLabel) and w.text():
            if not w.wordWrap() and w.width() < w.minimumSizeHint().width():
                found.append(f"{name} {w.text()[:40]!r} is {w.width()} px wide, needs "
                             f"{w.minimumSizeHint().width()}")
            elif w.wordWrap() and w.height() < w.heightForWidth(w.width()):
                found.append(f"{name} {w.text()[:40]!r} is {w.height()} px tall, needs "
                             f"{w.heightForWidth(w.width())}")
        if isinstance(w, QAbstractScrollArea) and not isinstance(w, QGraphicsView) \
                and w.horizontalScrollBarPolicy() == Qt.ScrollBarPolicy.ScrollBarAlwaysOff \
                and getattr(w, "widget", None) is not None and w.widget() is not None \
                and w.widget().width() > w.viewport().width():
            found.append(f"{name}: content {w.widget().width()} px wide in a "
                         f"{w.viewport().width()} px view that does not scroll sideways")
    return found


def table_problems(table, where: str) -> list[str]:
    """Columns of ``table`` cut off by its view, or narrower than their header's text."""
    header, found = table.header(), []
    if table.topLevelItemCount() == 0:
        return [f"{where}: the Runs table lists no run"]
    view = table.viewport().width()
    for i in range(header.count()):
        name = table.headerItem().text(i)
        right = header.sectionViewportPosition(i) + header.sectionSize(i)
        if right > view:
            found.append(f"{where}: column {name!r} ends at {right} px in a {view} px table")
        if header.sectionSize(i) < header.fontMetrics().horizontalAdvance(name) + 8:
            found.append(f"{where}: column {name!r} is {header.sectionSize(i)} px, narrower "
                         f"than its title")
    return found


def make_runs(runs_dir: Path, model: str, data: Path) -> None:
    """Two short real runs on the CPU engine, as the Runs page lists them."""
    from slideformer.engine.api import RunConfig, override, run_training, write_task
    write_task(data, 32, seed=1)
    for name, lr in (("tiny-llama-20261201-101500", 1e-3), ("tiny-llama-20261201-104500", 3e-3)):
        run_training(override(RunConfig(), {
            "model.path": model, "data.train": str(data), "data.max_seq_len": 32,
            "train.max_steps": 2, "train.micro_batch": 2, "train.device": "cpu",
            "optim.lr": lr, "output.run_dir": str(runs_dir / name)}))


def collapsed_problems(window, run_loop) -> list[str]:
    """Fold the Monitor to its strip: the strip is narrow and every page still fits; then
    unfold it: the dock is as wide as before."""
    from slideformer.gui.widgets.dock import STRIP_PX
    dock, found = window.monitor_dock, []
    wide = dock.width()
    dock.collapse_button.click()
    run_loop(400)
    if not (dock.isVisible() and dock.strip.isVisible() and dock.width() == STRIP_PX):
        found.append(f"collapsed: the Monitor is {dock.width()} px wide, not a {STRIP_PX} px "
                     f"strip")
    for title in window.pages:
        window.show_page(title)
        run_loop(300)
        found += problems(window, f"collapsed Monitor, {title}")
    dock.expand_button.click()
    run_loop(400)
    if not dock.content.isVisible() or dock.width() != wide:
        found.append(f"expanded: the Monitor is {dock.width()} px wide, was {wide}")
    return found


def main(out: str) -> int:
    from slideformer.gui.app import make_application
    from slideformer.gui.context import AppContext
    from slideformer.gui.main_window import MainWindow
    from slideformer.gui.pages.model import ensure_demo_model
    from slideformer.gui.capture import run_loop, wait_until
    from slideformer.gui.settings import Settings

    make_application()
    tmp = Path(tempfile.mkdtemp(prefix="geometry-"))
    ctx = AppContext(Settings(QSettings(str(tmp / "s.ini"), QSettings.Format.IniFormat)),
                     data_dir=tmp / "data", gpu_source="none")
    window = MainWindow(ctx)
    window.resize(*SIZE)
    window.show()
    window.model_page.load(ensure_demo_model(ctx.demo_model_dir))
    wait_until(lambda: ctx.model_path is not None, 60000)
    make_runs(ctx.runs_dir, ctx.model_path, tmp / "task.jsonl")
    runs = window.pages["Runs"]
    report = {"window": [window.width(), window.height()],
              "monitor": window.monitor_dock.isVisible(), "problems": []}
    for theme in ("light", "dark"):
        window.set_theme(theme)
        for title in window.pages:
            window.show_page(title)
            run_loop(400)
            report["problems"] += problems(window, f"{theme} {title}")
            if title == "Runs":
                wait_until(lambda: runs.table.topLevelItemCount() == 2, 30000)
                report["problems"] += table_problems(runs.table, f"{theme} Runs")
            if (window.width(), window.height()) != SIZE:  # it grew past the screen
                report["problems"].append(f"{theme} {title}: the window is {window.width()}x"
                                          f"{window.height()} on a {SIZE[0]}x{SIZE[1]} screen")
    report["problems"] += collapsed_problems(window, run_loop)
    Path(out).write_text(json.dumps(report, indent=1))
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
