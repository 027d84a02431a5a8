"""The engine's command line: ``python -m slideformer.engine.cli`` (every command but the desktop app's).

Each subcommand lives next to the code it drives and registers itself through a
``register(subparsers)`` function of a module in :data:`COMMANDS`; the handler it sets as ``func``
receives the parsed arguments and returns an exit code. A :class:`UserError` anywhere becomes one
message on stderr and exit code 2, never a traceback; so does an ``OSError`` about a path (a file
standing where a folder should be, a read-only folder).

Building the parser imports no torch: command modules import their heavy parts inside their
handlers, so ``--help`` and the commands that need no torch start fast. The ``slideformer``
command adds the desktop app's ``gui`` command on top (:mod:`slideformer.cli`); the engine never
names the app.
"""
from __future__ import annotations

import argparse
import sys
from types import ModuleType

from slideformer.engine import __version__
from slideformer.engine.data import commands as data_commands
from slideformer.engine.dist import commands as dist_commands
from slideformer.engine.errors import UserError, path_error
from slideformer.engine.gguf import commands as gguf_commands
from slideformer.engine.generate import commands as generate_commands
from slideformer.engine.models import commands as model_commands
from slideformer.engine.plan import commands as plan_commands
from slideformer.engine.train import commands as train_commands

COMMANDS: tuple[ModuleType, ...] = (model_commands, gguf_commands, data_commands, train_commands,
                                   plan_commands, generate_commands, dist_commands)
"""Modules with a ``register(subparsers)`` function, in the order shown by --help."""


def build_parser(commands: tuple[ModuleType, ...] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slideformer",
        description="Full-parameter fine-tuning of models larger than your GPU.")
    parser.add_argument("--version", action="version", version=f"slideformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in commands:
        module.register(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None,
        default_command: str | None = None) -> int:
    """Parse ``argv`` and run its command; a bare command line runs ``default_command`` (None:
    prints the help)."""
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8 must still print
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = parser.parse_args(argv)
    if args.command is None:
        if default_command is None:
            parser.print_help()
            return 0
        args = parser.parse_args([default_command] + (sys.argv[1:] if argv is None else list(argv)))
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:  # not about a path the user gave: a bug to report as is
            raise
        print(f"error: {path_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
