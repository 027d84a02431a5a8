"""The window at 1366x768 on a real X server (Xvfb, Qt's xcb platform), with the Monitor dock
visible: no widget outside the window or clipped by its parent, no label narrower than its
text, on every page and in both themes (tests/gui/geometry_probe.py lists the problems).

Starts its own Xvfb on a free display; skips where ``Xvfb`` is not installed."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture
def xvfb():
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    read, write = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-screen", "0", "1366x768x24",
                               "-nolisten", "tcp"], pass_fds=(write,),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    with os.fdopen(read) as f:
        display = f.readline().strip()  # written once the server accepts clients
    try:
        assert display, "Xvfb did not start"
        yield f":{display}"
    finally:
        server.terminate()
        server.wait(10)


def test_every_page_fits_a_1366x768_screen_with_the_monitor(xvfb, tmp_path):
    out = tmp_path / "geometry.json"
    env = dict(os.environ, DISPLAY=xvfb, QT_QPA_PLATFORM="xcb", HOME=str(tmp_path),
               XDG_DATA_HOME=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    done = subprocess.run([sys.executable, str(HERE / "geometry_probe.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["window"] == [1366, 768] and report["monitor"]
    assert report["problems"] == []
