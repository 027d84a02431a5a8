"""Numbers and paths written for people: byte sizes, large counts, home-relative paths."""
from __future__ import annotations

from pathlib import Path

# the engine's byte format under the GUI's name: one size format in messages and on every page
from slideformer.engine.api import format_bytes as human_bytes

__all__ = ["RESOURCE_TITLES", "home_relative", "human_bytes", "human_count", "resource_title",
           "short_path"]


def human_count(n: int) -> str:
    """357216 -> "357.2 K", 8030261248 -> "8.03 B"."""
    for div, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if abs(n) >= div:
            return f"{n / div:.{digits}f} {suffix}"
    return str(n)


def home_relative(text: str) -> str:
    """``text`` (an engine message) with every path in the home folder written as "~/..." like
    the paths the app shows itself."""
    home = str(Path.home()).rstrip("/\\")
    return text.replace(home + "/", "~/").replace(home + "\\", "~\\")


def short_path(p: Path | str) -> str:
    """``p`` with the home folder written as "~"."""
    p = Path(p)
    try:
        return str(Path("~") / p.relative_to(Path.home()))
    except ValueError:
        return str(p)


RESOURCE_TITLES = {"gpu compute": "GPU compute", "pcie h2d": "PCIe to GPU",
                   "pcie d2h": "PCIe from GPU", "cpu optimizer": "CPU optimizer", "disk": "Disk"}
"""The planner's resources (what bounds a step) as people name them."""


def resource_title(name: str, device: str) -> str:
    """The name of the resource ``name`` on the backend ``device`` (cuda or cpu): on the CPU
    backend the forward and backward are the CPU's work, not a GPU's."""
    if device == "cpu" and name == "gpu compute":
        return "CPU compute"
    return RESOURCE_TITLES.get(name, name)
