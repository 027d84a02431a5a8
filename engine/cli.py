"""The ``slideformer`` command line.

Each subcommand lives next to the code it drives and registers itself through a
``register(subparsers)`` function listed in :data:`COMMANDS`; the handler it sets as ``func``
receives the parsed arguments and returns an exit code. A :class:`UserError` anywhere becomes one
message on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from engine import __version__
from engine.errors import UserError

# Modules with a ``register(subparsers)`` function, in the order shown by --help.
COMMANDS = [
    "slideformer_gui.commands",
    "engine.models.commands",
    "engine.gguf.commands",
    "engine.data.commands",
    "engine.train.commands",
    "engine.plan.commands",
]
# What a bare ``slideformer`` runs; None prints the help.
DEFAULT_COMMAND: str | None = "gui"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slideformer",
        description="Full-parameter fine-tuning of models larger than your GPU.")
    parser.add_argument("--version", action="version", version=f"slideformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        if DEFAULT_COMMAND is None:
            parser.print_help()
            return 0
        args = parser.parse_args([DEFAULT_COMMAND] + (sys.argv[1:] if argv is None else list(argv)))
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
