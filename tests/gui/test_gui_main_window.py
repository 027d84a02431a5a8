"""The main window: pages, the Monitor dock, themes, remembered layout, About, the CLI entry."""
import os
import subprocess
import sys
from pathlib import Path

import torch
from PySide6.QtWidgets import QApplication

from slideformer.engine import __version__
from slideformer.gui.pages.about import versions
from slideformer.gui.context import AppContext
from slideformer.gui.main_window import PAGES, MainWindow
from slideformer.gui.theme import style_sheet

ROOT = Path(__file__).resolve().parents[2]


def _action(window, menu_title, text):
    menu = next(a.menu() for a in window.menuBar().actions() if a.text() == menu_title)
    return next(a for a in menu.actions() if a.text() == text)


def test_every_page_opens_with_the_monitor_beside_it(qtbot, window):
    assert [window.sidebar.item(i).text() for i in range(window.sidebar.count())] == [
        title for title, _, _ in PAGES]
    for title, _, _ in PAGES:
        window.show_page(title)
        assert window.stack.currentWidget() is window.pages[title]
        assert window.pages[title].isVisible()
        assert window.monitor_dock.isVisible()


def test_view_menu_toggles_the_monitor_and_the_theme(qtbot, window, ctx):
    monitor = _action(window, "&View", "Monitor")
    monitor.trigger()
    assert not window.monitor_dock.isVisible()
    monitor.trigger()
    assert window.monitor_dock.isVisible()

    _action(window, "&View", "Dark theme").trigger()
    assert QApplication.instance().styleSheet() == style_sheet("dark")
    assert ctx.settings.theme() == "dark"
    _action(window, "&View", "Dark theme").trigger()
    assert QApplication.instance().styleSheet() == style_sheet("light")


def test_the_monitor_collapses_to_a_strip_and_expands_again(qtbot, window, ctx, tmp_path):
    from PySide6.QtCore import Qt
    from slideformer.gui.widgets.dock import STRIP_PX
    dock = window.monitor_dock
    page = window.stack.currentWidget()
    wide, page_width = dock.width(), page.width()
    qtbot.mouseClick(dock.collapse_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dock.width() == STRIP_PX)
    assert dock.isVisible() and dock.strip.isVisible() and not dock.content.isVisible()
    qtbot.waitUntil(lambda: page.width() > page_width)  # the pages get the room back
    assert _action(window, "&View", "Collapse the Monitor to a strip").isChecked()
    qtbot.mouseClick(dock.expand_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dock.width() == wide)
    assert dock.content.isVisible() and not dock.strip.isVisible()

    dock.collapse_action.trigger()  # View > Collapse: remembered for the next session
    window.close()
    again = MainWindow(AppContext(ctx.settings, data_dir=tmp_path, gpu_source="none"))
    qtbot.addWidget(again)
    again.show()
    assert again.monitor_dock.collapsed and again.monitor_dock.strip.isVisible()
    again.close()


def test_layout_and_theme_are_remembered(qtbot, window, ctx, tmp_path):
    window.set_theme("dark")
    window.monitor_dock.hide()
    window.resize(700, 650)  # Qt's offscreen screen is 800 x 800
    size = window.size()
    window.close()
    assert ctx.settings.window_geometry() is not None and ctx.settings.window_state() is not None

    again = MainWindow(AppContext(ctx.settings, data_dir=tmp_path, gpu_source="none"))
    qtbot.addWidget(again)
    again.show()
    assert again.dark_action.isChecked()
    assert not again.monitor_dock.isVisible()
    assert again.height() == size.height() == 650  # restored (widths clamp to the screen)
    again.set_theme("light")
    again.close()


def test_recent_list_has_no_duplicates_and_a_cap(settings):
    for i in range(15):
        settings.add_recent_model(f"/models/m{i}")
    settings.add_recent_model("/models/m10")
    recent = settings.recent_models()
    assert recent[0] == "/models/m10" and len(recent) == 10 and len(set(recent)) == 10


def test_about_dialog_shows_versions(qtbot, window):
    about = window.show_about()
    qtbot.waitUntil(lambda: about.values["NVIDIA driver"].text() != "…", timeout=10000)
    assert about.values["slideformer"].text() == __version__
    assert about.values["torch"].text() == torch.__version__
    if torch.version.cuda is None:
        assert about.values["CUDA"].text() == "none"
    about.close()


def test_driver_version_comes_from_nvml(fake_nvml):
    fake_nvml()
    assert versions()["NVIDIA driver"] == "555.42.02"
    fake_nvml(init_error="NVML Shared Library Not Found")
    assert versions()["NVIDIA driver"] == "no NVIDIA GPU"


def _cli(code: str):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_cli_without_a_display():
    """``--help`` imports no Qt; ``gui`` (the default) explains the missing display."""
    r = _cli(code="import sys; from slideformer.cli import DEFAULT_COMMAND, build_parser, main; "
                  "build_parser().format_help(); print(DEFAULT_COMMAND, 'PySide6' in sys.modules); "
                  "print(main([]))")
    assert r.stdout.split() == ["gui", "False", "2"], r.stderr
    assert "no graphical display" in r.stderr and "Traceback" not in r.stderr
