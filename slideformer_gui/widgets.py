"""Small pieces every page uses: the page header and state-styled labels."""
from __future__ import annotations

from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget


def page_header(title: str, subtitle: str) -> QWidget:
    """A page's title and one sentence on what the page is for."""
    box = QWidget()
    lay = QVBoxLayout(box)
    lay.setContentsMargins(0, 0, 0, 4)
    lay.setSpacing(2)
    t = QLabel(title)
    t.setObjectName("pageTitle")
    s = QLabel(subtitle)
    s.setObjectName("pageSubtitle")
    s.setWordWrap(True)
    lay.addWidget(t)
    lay.addWidget(s)
    return box


def set_state(widget: QWidget, state: str) -> None:
    """Set the ``state`` property the style sheets key on (info, busy, ok, error) and restyle."""
    widget.setProperty("state", state)
    widget.style().unpolish(widget)
    widget.style().polish(widget)


def fixed_width(label: QLabel) -> QLabel:
    """Let ``label`` take the width its layout gives it, whatever its text.

    A label that changes its text many times a second (a live value) would otherwise ask for a
    new layout each time, and the whole page around it would be laid out and repainted.
    """
    policy = label.sizePolicy()
    policy.setHorizontalPolicy(QSizePolicy.Policy.Ignored)
    label.setSizePolicy(policy)
    return label
