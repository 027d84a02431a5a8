"""Numbers and paths written for people: byte sizes, large counts, home-relative paths."""
from __future__ import annotations

from pathlib import Path

# the engine's formats under the GUI's names: one way sizes and counts read everywhere
from slideformer.engine.api import format_bytes as human_bytes
from slideformer.engine.api import format_count as human_count

__all__ = ["RESOURCE_TITLES", "home_relative", "human_bytes", "human_count", "resource_title",
           "short_path"]


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
