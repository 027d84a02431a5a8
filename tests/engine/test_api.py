"""The engine's front door (slideformer.engine.api) and the command line built on it: what a front end may
import, and what building the parser costs."""
import subprocess
import sys
from pathlib import Path

import slideformer.engine.api

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_every_exported_name_exists():
    missing = [name for name in slideformer.engine.api.__all__ if not hasattr(slideformer.engine.api, name)]
    assert not missing and len(set(slideformer.engine.api.__all__)) == len(slideformer.engine.api.__all__)


def test_building_the_parser_imports_neither_torch_nor_qt():
    """``slideformer --help`` and commands that need no torch start without importing it."""
    for module in ("slideformer.cli", "slideformer.engine.cli"):
        r = _python(f"import sys, {module} as cli; cli.build_parser().format_help(); "
                    "print(sorted(m for m in ('torch', 'PySide6', 'slideformer.engine.api') "
                    "if m in sys.modules))")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "[]", (module, r.stdout)


def test_info_of_a_model_folder_imports_no_torch(tiny_model_factory):
    r = _python("import sys; from slideformer.cli import main; "
                f"rc = main(['info', {str(tiny_model_factory('llama'))!r}]); "
                "print(rc, 'torch' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["0", "False"]


def test_the_gui_imports_the_engine_only_through_engine_api():
    r = subprocess.run([sys.executable, "tools/import_edges.py", "--check", "slideformer.engine.api"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_engine_never_names_the_gui():
    named = [str(p.relative_to(REPO)) for p in (REPO / "slideformer" / "engine").rglob("*.py")
             if "slideformer.gui" in p.read_text(encoding="utf-8")]
    assert named == []


def test_engine_cli_has_no_gui_command_and_slideformer_adds_it():
    from slideformer.engine.cli import build_parser as engine_parser
    from slideformer.cli import DEFAULT_COMMAND, build_parser

    def commands(parser):
        return set(next(a for a in parser._actions if a.dest == "command").choices)

    assert "gui" not in commands(engine_parser()) and DEFAULT_COMMAND == "gui"
    assert commands(build_parser()) == commands(engine_parser()) | {"gui"}
