"""CLI: ``slideformer gui`` (also what a bare ``slideformer`` runs).

Qt and the engine (:mod:`slideformer.engine.api`, which imports torch) are imported only when the command
runs, so ``slideformer --help`` starts fast and every other command works on a machine without a
display or without Qt's system libraries.
"""
from __future__ import annotations

import os
import sys


def register(sub) -> None:
    p = sub.add_parser("gui", help="open the desktop app (the default command)")
    p.add_argument("--model", help="model folder to choose at start")
    p.add_argument("--self-test", action="store_true",
                   help="check this installation (tiny model, 3 training steps, every page "
                        "rendered) and exit; offscreen unless --platform is given")
    p.add_argument("--platform", metavar="NAME",
                   help="with --self-test: open the window on this Qt platform (xcb, wayland; "
                        "native: the one the app uses here), so missing system libraries show")
    p.set_defaults(func=_gui)


def _check_display() -> None:
    """On Linux, Qt aborts the process when there is no display: say so in words instead."""
    if not sys.platform.startswith("linux"):
        return
    if not any(os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")):
        from slideformer.engine.api import UserError
        raise UserError("display", "no graphical display was found (DISPLAY and WAYLAND_DISPLAY "
                                   "are not set)",
                        "run the app in a desktop session, or use the terminal commands "
                        "(slideformer --help)")


def _gui(args) -> int:
    if args.self_test:
        from slideformer.gui.self_test import run_self_test
        return run_self_test(args.platform)
    if args.platform:
        from slideformer.engine.api import UserError
        raise UserError("--platform", "is for --self-test", "add --self-test, or leave it out")
    _check_display()
    from slideformer.gui.platform_check import check_platform
    check_platform()
    try:
        from slideformer.gui.app import run
    except ImportError as e:
        from slideformer.engine.api import UserError
        raise UserError("PySide6", f"Qt could not be loaded ({e})",
                        "install Qt's system libraries; on Debian/Ubuntu: apt-get install "
                        "libegl1 libgl1 libxkbcommon0 libfontconfig1 libglib2.0-0 libdbus-1-3") \
            from None
    return run(args.model)
