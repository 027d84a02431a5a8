"""The documentation screenshots script still renders every page."""
from PySide6.QtGui import QImage

from tools.screenshots.model import render


def test_screenshots_render(qtbot, tmp_path):
    paths = render(tmp_path / "shots")
    assert {p.name for p in paths} >= {"model-light.png", "model-dark.png", "about.png"}
    for p in paths:
        image = QImage(str(p))
        assert not image.isNull() and image.width() >= 300
