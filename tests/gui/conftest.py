"""Fixtures for the desktop app's tests: offscreen Qt, throw-away settings and data folders."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before any QApplication exists

import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QSettings  # noqa: E402

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _collect_in_gui_thread(qapp):
    """As in the app: cyclic garbage collection on a GUI-thread timer only (a collection in a
    worker thread that frees Qt objects crashes); automatic collection is restored after the
    test, so the other test folders run as usual."""
    import gc
    from slideformer.gui.app import collect_in_gui_thread
    collect_in_gui_thread(qapp)
    yield
    qapp._collector.timer.stop()
    qapp._collector = None
    gc.enable()


@pytest.fixture(autouse=True)
def _no_user_files(tmp_path, monkeypatch):
    """No test reads or writes the real user's settings or data folder."""
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope,
                      str(tmp_path / "qsettings"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


@pytest.fixture(autouse=True)
def _no_user_models(monkeypatch):
    """No test lists the real user's models: the Model page scans this machine's model stores
    when it is first shown, and here that scan finds none (tests/gui/pages/
    test_gui_model_discovery.py puts the real one back, on stores of its own)."""
    from slideformer.gui.pages import model_found
    monkeypatch.setattr(model_found, "scan", lambda folders, roots: ([], 0.0))


@pytest.fixture
def settings(tmp_path):
    from slideformer.gui.settings import Settings
    return Settings(QSettings(str(tmp_path / "studio.ini"), QSettings.Format.IniFormat))


@pytest.fixture
def ctx(settings, tmp_path):
    from slideformer.gui.context import AppContext
    return AppContext(settings, data_dir=tmp_path / "data", gpu_source="none")


@pytest.fixture
def window(qtbot, ctx):
    from slideformer.gui.app import make_application
    from slideformer.gui.main_window import MainWindow
    make_application()
    w = MainWindow(ctx)
    qtbot.addWidget(w)
    w.show()
    yield w
    w.close()


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory):
    """A tiny Llama folder shared by the session (read-only: copy it before breaking it)."""
    return tiny_model_factory("llama")


class _NvmlError(Exception):
    pass


def _fake_pynvml(count, init_error):
    """A stand-in for the pynvml module: one 24 GiB GPU without power reporting."""
    m = types.SimpleNamespace(NVMLError=_NvmlError, NVML_PCIE_UTIL_RX_BYTES=1,
                              NVML_PCIE_UTIL_TX_BYTES=0, NVML_TEMPERATURE_GPU=0)
    m.shutdowns = 0

    def init():
        if init_error:
            raise _NvmlError(init_error)

    def no_power(h):
        raise _NvmlError("Not Supported")

    def shutdown():
        m.shutdowns += 1

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 4090"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=6 * GIB, total=24 * GIB)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    m.nvmlDeviceGetPcieThroughput = lambda h, c: 20_000_000 if c == 1 else 5_000_000  # KB/s
    m.nvmlDeviceGetTemperature = lambda h, s: 71
    m.nvmlDeviceGetPowerUsage = no_power
    m.nvmlSystemGetDriverVersion = lambda: "555.42.02"
    return m


@pytest.fixture
def fake_nvml(monkeypatch):
    """``fake_nvml(count=1, init_error=None)`` puts a fake ``pynvml`` module in place."""
    def install(count=1, init_error=None):
        module = _fake_pynvml(count, init_error)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module
    return install
