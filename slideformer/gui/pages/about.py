"""The About dialog: what this is, and the versions that matter when reporting a problem."""
from __future__ import annotations

import platform

from PySide6 import __version__ as pyside_version
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFormLayout, QLabel, QVBoxLayout

from slideformer.engine.api import __version__
from slideformer.gui.workers.thread import run_task


def nvidia_driver() -> str:
    """The NVIDIA driver version through NVML, or "no NVIDIA GPU"."""
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return "no NVIDIA GPU"
    try:
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except pynvml.NVMLError:
        return "no NVIDIA GPU"
    finally:
        pynvml.nvmlShutdown()


VERSION_NAMES = ("slideformer", "Python", "PySide6 (Qt)", "torch", "CUDA", "NVIDIA driver")


def versions() -> dict[str, str]:
    """Name -> version of slideformer, Python, Qt, torch, CUDA and the NVIDIA driver."""
    import torch
    if torch.version.cuda is None:
        cuda = "none"
    elif torch.cuda.is_available():
        cuda = f"{torch.version.cuda} ({torch.cuda.get_device_name(0)})"
    else:
        cuda = f"{torch.version.cuda} (no GPU visible)"
    return {"slideformer": __version__, "Python": platform.python_version(),
            "PySide6 (Qt)": pyside_version, "torch": torch.__version__, "CUDA": cuda,
            "NVIDIA driver": nvidia_driver()}


class AboutDialog(QDialog):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("About SlideFormer Studio")
        title = QLabel("SlideFormer Studio")
        title.setObjectName("pageTitle")
        blurb = QLabel("Full-parameter fine-tuning of language models larger than your GPU, "
                       "on one GPU: the GPU works on a sliding window of layers while the CPU "
                       "holds the model state and runs the optimizer.")
        blurb.setWordWrap(True)
        form = QFormLayout()
        self.values: dict[str, QLabel] = {}
        for name in VERSION_NAMES:
            label = QLabel("…")
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.values[name] = label
            form.addRow(name, label)
        # Asking the CUDA runtime and NVML can take a second on some machines: off the GUI thread.
        self.task = run_task(versions, name="versions", owner=self, done=self._show_versions)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(title)
        lay.addWidget(blurb)
        lay.addLayout(form)
        lay.addWidget(buttons)
        self.setMinimumWidth(420)

    def _show_versions(self, found: dict[str, str]) -> None:
        for name, value in found.items():
            self.values[name].setText(value)
