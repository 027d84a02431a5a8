"""Start the desktop app: one QApplication, the main window, the event loop."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

from PySide6.QtWidgets import QApplication

from slideformer.engine.api import __version__
from slideformer.gui.context import AppContext
from slideformer.gui.main_window import MainWindow
from slideformer.gui.settings import APPLICATION, ORGANISATION, Settings
from slideformer.gui.theme import icon


def make_application() -> QApplication:
    """The process's QApplication (created once), named so QSettings finds its file, with
    garbage collection moved to the GUI thread (:func:`collect_in_gui_thread`)."""
    app = QApplication.instance() or QApplication(sys.argv[:1])
    collect_in_gui_thread(app)
    app.setOrganizationName(ORGANISATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationVersion(__version__)
    app.setStyle("Fusion")  # the style sheets are written against Fusion on every platform
    app.setWindowIcon(icon("slideformer.svg"))
    return app


def collect_in_gui_thread(app: QApplication) -> None:
    """Run Python's cyclic garbage collector on a GUI-thread timer only (pyqtgraph's
    GarbageCollector). Automatic collection runs in whichever thread allocates: a cycle holding
    Qt objects collected in a worker thread (the machine probe, the planner's reader) deletes
    them off their thread and crashed the process (a segfault in the GUI suite, 2026-12-01)."""
    from pyqtgraph.util.garbage_collector import GarbageCollector
    if getattr(app, "_collector", None) is None:
        app._collector = GarbageCollector(interval=0.5)


def freeze_heap() -> None:
    """Exempt every object alive now from garbage collection scans.

    With torch, numpy and Qt imported the heap holds hundreds of thousands of long-lived
    objects, and a full collection that walks them all stalls the GUI thread for 50-120 ms
    (measured with ``gc.callbacks`` in the GUI test suite). Objects made at start-up live as
    long as the app, so they are moved out of the collector's way once, after start-up.
    """
    gc.collect()
    gc.freeze()


def run(model: str | None = None) -> int:
    """Show the main window until it is closed, with ``model`` chosen (default: the last one)."""
    app = make_application()
    settings = Settings()
    window = MainWindow(AppContext(settings))
    freeze_heap()
    window.show()
    recent = settings.recent_models()
    if model is None and recent and Path(recent[0]).is_dir():
        model = recent[0]
    if model:
        window.model_page.load(model)
    return app.exec()
