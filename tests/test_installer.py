"""``build_installer.py`` builds the desktop bundle and the bundle passes its self-test in a clean
environment. Takes minutes and needs PyInstaller (``pip install -e '.[installer]'``)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_build_and_smoke():
    pytest.importorskip("PyInstaller")
    for extra in ([], ["--smoke"]):
        done = subprocess.run([sys.executable, str(ROOT / "build_installer.py"), *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "self-test passed" in done.stdout
