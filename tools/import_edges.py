"""Count the import edges from one package into another (``file -> module`` pairs).

    python tools/import_edges.py                       # slideformer.gui -> engine, by module
    python tools/import_edges.py --check slideformer.engine.api    # exit 1 unless every edge ends there

An edge is one file of the source package importing one module of the target package (a
``from slideformer.engine.plan import Fix, Plan`` line is one edge to ``slideformer.engine.plan``; the same module imported
twice by one file counts once). Imports inside functions count: they are dependencies too.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def edges(source: Path, target: str) -> set[tuple[str, str]]:
    """Every (file, module) pair where a file under ``source`` imports ``target`` or a module
    under it."""
    found = set()
    for path in sorted(source.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name == target or name.startswith(target + "."):
                    found.add((str(path.relative_to(ROOT)), name))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="slideformer/gui", help="package folder to scan")
    p.add_argument("--target", default="slideformer.engine", help="package whose imports are counted")
    p.add_argument("--check", metavar="MODULE", help="fail unless every edge imports MODULE")
    a = p.parse_args(argv)
    found = edges(ROOT / a.source, a.target)
    by_module = Counter(module for _, module in found)
    files = {f for f, _ in found}
    print(f"{a.source} -> {a.target}: {len(found)} edges from {len(files)} files "
          f"to {len(by_module)} modules")
    for module, n in sorted(by_module.items()):
        print(f"  {n:3d}  {module}")
    if a.check:
        stray = sorted(e for e in found if e[1] != a.check)
        for f, module in stray:
            print(f"not through {a.check}: {f} imports {module}", file=sys.stderr)
        return 1 if stray else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
