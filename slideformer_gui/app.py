"""Start the desktop app: one QApplication, the main window, the event loop."""
from __future__ import annotations

import ctypes
import gc
import sys
from pathlib import Path

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QApplication

from engine.api import __version__
from slideformer_gui.context import AppContext
from slideformer_gui.main_window import MainWindow
from slideformer_gui.settings import APPLICATION, ORGANISATION, Settings
from slideformer_gui.theme import icon


_singletons_kept = False


def keep_singletons_alive() -> None:
    """Protect Python < 3.12 from Qt bindings that drop references to None, True and False.

    PySide6 6.12.0 on Python 3.11 loses one reference to None on every call of a Qt method that
    returns void or None (QLabel.setText, QTimer.start, QComboBox.currentData...) and one to
    True on every signal ``emit`` and ``connect`` (measured: -1 per call; 6.11.3 loses none).
    Python aborts ("none_dealloc", "bool_dealloc") when a count reaches zero: for True after a
    few thousand emits, for None after ~66,000 calls -- minutes of live charts. Python 3.12 made
    these objects immortal; here, when a probe shows the leak, their counts are raised once by
    2**40, which no session can use up.
    """
    global _singletons_kept
    if sys.version_info >= (3, 12) or _singletons_kept:
        return
    _singletons_kept = True
    probe, calls = QObject(), 64
    before = sys.getrefcount(None)
    for _ in range(calls):
        probe.setObjectName("probe")
    if before - sys.getrefcount(None) >= calls // 2:
        for singleton in (None, True, False):
            ctypes.c_ssize_t.from_address(id(singleton)).value += 1 << 40  # ob_refcnt


def make_application() -> QApplication:
    """The process's QApplication (created once), named so QSettings finds its file."""
    keep_singletons_alive()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setOrganizationName(ORGANISATION)
    app.setApplicationName(APPLICATION)
    app.setApplicationVersion(__version__)
    app.setStyle("Fusion")  # the style sheets are written against Fusion on every platform
    app.setWindowIcon(icon("slideformer.svg"))
    return app


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
