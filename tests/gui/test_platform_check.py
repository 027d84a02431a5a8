"""Missing Qt platform libraries are named, with the packages to install, before Qt starts.

The failing case is real: PySide6's own xcb plugin copied where its Qt libraries cannot be
found, so the system loader refuses it the way it refuses a plugin whose libxcb-cursor0 is
missing (which this machine has, so it cannot be taken away here)."""
import os
import shutil
import subprocess
import sys

import pytest

from slideformer.engine.errors import UserError
from slideformer.gui import platform_check as pc


def test_package_names_follow_debian():
    assert pc.package_of("libxcb-cursor.so.0") == "libxcb-cursor0"
    assert pc.package_of("libxcb-icccm.so.4") == "libxcb-icccm4"
    assert pc.package_of("libxkbcommon-x11.so.0") == "libxkbcommon-x11-0"
    assert pc.package_of("libdbus-1.so.3") == "libdbus-1-3"
    assert pc.package_of("libEGL.so.1") == "libegl1"
    assert pc.package_of("libglib-2.0.so.0") == "libglib2.0-0"
    assert pc.package_of("libicuuc.so.73") == "libicu73" and pc.package_of("libz.so.1") == "zlib1g"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the xcb plugin is Linux's")
def test_a_plugin_that_cannot_load_names_its_libraries(tmp_path, monkeypatch):
    real = pc.plugin_path("xcb")
    if real is None:
        pytest.skip("PySide6 has no xcb plugin here")
    copy = tmp_path / "plugins" / "platforms" / real.name
    copy.parent.mkdir(parents=True)
    shutil.copy(real, copy)  # its RUNPATH ($ORIGIN/../../lib) now leads nowhere
    missing = pc.missing_libraries(copy)
    assert "libQt6XcbQpa.so.6" in missing
    monkeypatch.setattr(pc, "plugin_path", lambda name: copy)
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    with pytest.raises(UserError) as e:
        pc.check_platform()
    text = str(e.value)
    assert "libQt6XcbQpa.so.6" in text and "pip install --force-reinstall PySide6" in text
    if not pc.missing_libraries(real):  # (where system libraries are missing too, both show)
        assert "apt-get" not in text  # Qt's own libraries come with PySide6, not the system


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the xcb plugin is Linux's")
def test_this_installation_can_load_its_xcb_plugin():
    """In a fresh process (the test process runs Qt offscreen already)."""
    env = dict(os.environ, QT_QPA_PLATFORM="xcb")
    done = subprocess.run([sys.executable, "-c", "from slideformer.gui.platform_check import "
                           "check_platform; check_platform(); print('ok')"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
