"""Light and dark looks: Qt style sheets shipped in ``slideformer/gui/resources/styles`` and the plot colours.

The style sheets are package data, read through ``importlib.resources`` so they are found in an
installed wheel and in a desktop bundle alike.
"""
from __future__ import annotations

from importlib import resources

from PySide6.QtGui import QColor, QIcon, QPalette, QPixmap

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
    return (resources.files("slideformer.gui") / "resources" / "styles" / f"{name}.qss").read_text(encoding="utf-8")


# Colours of the dark palette (role -> colour): the style sheet styles the app's own widgets,
# the palette the standard ones (inputs, lists, tabs) so Fusion still draws their arrows.
DARK_PALETTE = {
    QPalette.ColorRole.Window: "#1b1f27", QPalette.ColorRole.WindowText: "#e5e7eb",
    QPalette.ColorRole.Base: "#161a22", QPalette.ColorRole.AlternateBase: "#1d222c",
    QPalette.ColorRole.Text: "#e5e7eb", QPalette.ColorRole.Button: "#2a3140",
    QPalette.ColorRole.ButtonText: "#e5e7eb", QPalette.ColorRole.Highlight: "#1e3a8a",
    QPalette.ColorRole.HighlightedText: "#dbeafe", QPalette.ColorRole.ToolTipBase: "#e5e7eb",
    QPalette.ColorRole.ToolTipText: "#111827", QPalette.ColorRole.PlaceholderText: "#6b7280",
    QPalette.ColorRole.Light: "#3b4456", QPalette.ColorRole.Mid: "#2a303c",
    QPalette.ColorRole.Dark: "#10131a", QPalette.ColorRole.Midlight: "#323a48",
}


def palette(name: str, standard: QPalette) -> QPalette:
    """The palette of theme ``name``: the style's own (``standard``) for light, else dark."""
    if name == "light":
        return standard
    pal = QPalette(standard)
    for role, colour in DARK_PALETTE.items():
        pal.setColor(role, QColor(colour))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText,
                 QPalette.ColorRole.ButtonText):
        pal.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6b7280"))
    return pal


def icon(name: str) -> QIcon:
    """An icon from ``slideformer/gui/resources/icons`` (e.g. "model.svg"; drawn at 128 px, scaled down)."""
    pixmap = QPixmap()
    pixmap.loadFromData((resources.files("slideformer.gui") / "resources" / "icons" / name).read_bytes())
    return QIcon(pixmap)
