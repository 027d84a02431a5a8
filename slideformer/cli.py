"""The ``slideformer`` command: the engine's commands plus ``gui``, the desktop app (the default).

This module sits above both packages: the engine's command line (:mod:`slideformer.engine.cli`) never names
the app, and the app's command (:mod:`slideformer.gui.commands`) imports Qt only when it runs.
"""
from __future__ import annotations

import argparse
import sys

from slideformer.engine import cli as engine_cli
from slideformer.gui import commands as gui_commands

COMMANDS = (gui_commands, *engine_cli.COMMANDS)
"""Modules with a ``register(subparsers)`` function, in the order shown by --help."""
DEFAULT_COMMAND = "gui"
"""What a bare ``slideformer`` runs."""


def build_parser() -> argparse.ArgumentParser:
    return engine_cli.build_parser(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return engine_cli.run(build_parser(), argv, DEFAULT_COMMAND)


if __name__ == "__main__":
    sys.exit(main())
