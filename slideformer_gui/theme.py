"""Light and dark looks: Qt style sheets shipped in ``resources/styles`` and the plot colours.

The style sheets are package data, read through ``importlib.resources`` so they are found in an
installed wheel and in a desktop bundle alike.
"""
from __future__ import annotations

from importlib import resources

from PySide6.QtGui import QIcon, QPixmap

THEMES = ("light", "dark")

PLOT_COLORS = {
    "light": ("#ffffff", "#4b5563"),
    "dark": ("#161a22", "#aeb6c2"),
}
"""Theme -> (plot background, axis and text colour)."""


def style_sheet(name: str) -> str:
    """The Qt style sheet of theme ``name``."""
    if name not in THEMES:
        raise ValueError(f"theme must be one of {THEMES}, not {name!r}")
    return (resources.files("resources") / "styles" / f"{name}.qss").read_text(encoding="utf-8")


def icon(name: str) -> QIcon:
    """An icon from ``resources/icons`` (e.g. "model.svg"; drawn at 128 px, scaled down)."""
    pixmap = QPixmap()
    pixmap.loadFromData((resources.files("resources") / "icons" / name).read_bytes())
    return QIcon(pixmap)
