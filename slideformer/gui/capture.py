"""Photographing the app: a studio main window in a scratch folder, waiting on the event loop,
saving a widget as PNG.

The self-test uses these to check a real window; the documentation's screenshot scripts
(tools/screenshots/) use them to take their pictures. A real X window (Qt's xcb platform; any X
server, Xvfb included) at 1366x768, a laptop's screen, with the Monitor showing what this machine
really has; the user's settings and data folder are not touched.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from PySide6.QtCore import QEventLoop, QSettings, QTimer
from PySide6.QtWidgets import QWidget

from slideformer.engine.api import UserError
from slideformer.gui.app import make_application
from slideformer.gui.context import AppContext
from slideformer.gui.main_window import DEFAULT_SIZE, MainWindow
from slideformer.gui.settings import Settings

WINDOW_SIZE = DEFAULT_SIZE


def run_loop(ms: int, done=lambda: False) -> None:
    """Run the event loop for ``ms`` milliseconds or until ``done()`` is true.

    A nested QEventLoop, not a ``processEvents()`` polling loop: PySide6 6.12's Python binding of
    processEvents drops a reference to None on every call, which crashes Python 3.11 after a
    few thousand calls.
    """
    loop = QEventLoop()
    poll = QTimer()
    poll.timeout.connect(lambda: done() and loop.quit())
    poll.start(10)
    QTimer.singleShot(ms, loop.quit)
    loop.exec()
    poll.stop()


def wait_until(done, timeout_ms: int = 20000) -> None:
    """Run the event loop until ``done()`` (the page's worker threads reported back)."""
    if not done():
        run_loop(timeout_ms, done)
    if not done():
        raise TimeoutError("the app did not settle in time")


def save(widget: QWidget, path: Path) -> Path:
    run_loop(200)  # let layouts and the charts' repaint timer run
    widget.grab().save(str(path))
    return path


def use_x_server() -> None:
    """Take the pictures in a real X window: the xcb platform, on the display of $DISPLAY
    (exits with one message when there is none)."""
    if not os.environ.get("DISPLAY"):
        raise SystemExit("error: " + str(UserError(
            "DISPLAY", "is not set: the screenshots are taken on an X server",
            'run under one, e.g. xvfb-run -s "-screen 0 1366x768x24" python -m '
            "tools.screenshots.runs")))
    os.environ["QT_QPA_PLATFORM"] = "xcb"


STORE_VARS = ("HF_HUB_CACHE", "OLLAMA_MODELS")
"""The model stores' variables (slideformer.engine.models.stores), set to the scratch home's
default places: the Model page lists what a script puts there, not this machine's models."""


@contextmanager
def studio_window(out: Path) -> Iterator[tuple[MainWindow, Path]]:
    """A main window on throw-away settings and data folders, and the folder standing as HOME.

    Creates ``out``, starts the application (offscreen unless QT_QPA_PLATFORM says otherwise,
    see :func:`use_x_server`), and closes the window and puts HOME (and :data:`STORE_VARS`)
    back afterwards.
    """
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # read when the QApplication starts
    out.mkdir(parents=True, exist_ok=True)
    make_application()
    saved = {k: os.environ.get(k) for k in ("HOME", *STORE_VARS)}
    try:
        with tempfile.TemporaryDirectory(prefix="studio-") as tmp:
            tmp = Path(tmp)
            os.environ["HOME"] = str(tmp)  # paths on screen read "~/...", not this machine's
            os.environ["HF_HUB_CACHE"] = str(tmp / ".cache" / "huggingface" / "hub")
            os.environ["OLLAMA_MODELS"] = str(tmp / ".ollama" / "models")
            settings = Settings(QSettings(str(tmp / "settings.ini"), QSettings.Format.IniFormat))
            ctx = AppContext(settings, data_dir=tmp / ".local" / "share" / "slideformer",
                             gpu_source="none")
            window = MainWindow(ctx)
            try:
                yield window, tmp
            finally:
                window.close()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def out_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a screenshot script: its docstring's first line and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    return parser


def print_paths(paths: list[Path]) -> int:
    """Print the pictures written, one a line; the script's exit status."""
    for path in paths:
        print(path)
    return 0
