"""Numbers and paths written for people: byte sizes, large counts, home-relative paths."""
from __future__ import annotations

from pathlib import Path


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; binary units, like the Monitor's GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """357216 -> "357.2 K", 8030261248 -> "8.03 B"."""
    for div, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if abs(n) >= div:
            return f"{n / div:.{digits}f} {suffix}"
    return str(n)


def short_path(p: Path | str) -> str:
    """``p`` with the home folder written as "~"."""
    p = Path(p)
    try:
        return str(Path("~") / p.relative_to(Path.home()))
    except ValueError:
        return str(p)
