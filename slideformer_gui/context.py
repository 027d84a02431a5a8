"""What every page shares: settings, where the app keeps its files, and the chosen model.

Pages never call each other. The Model page calls :meth:`AppContext.set_model`; any page that
needs the model (Plan, Data, Train) connects to :attr:`AppContext.model_changed` and reads
:attr:`AppContext.model_path` when it is built.
"""
from __future__ import annotations

from pathlib import Path

import platformdirs
from PySide6.QtCore import QObject, Signal

from slideformer_gui.settings import Settings


def default_data_dir() -> Path:
    """The per-user folder for the app's own files (demo model, runs, caches)."""
    return Path(platformdirs.user_data_dir("slideformer"))


class AppContext(QObject):
    """Shared state of one main window."""

    model_changed = Signal(str)
    """A valid model folder was chosen (its path)."""

    def __init__(self, settings: Settings, data_dir: Path | None = None, gpu_source: str = "nvml"):
        super().__init__()
        self.settings = settings
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.gpu_source = gpu_source
        """Where the Monitor reads GPU figures: "nvml", "fake" or "none"."""
        self.model_path: str | None = None
        self.model_report: dict | None = None
        """The engine's summary of the chosen model (``engine.models.commands.model_report``)."""

    @property
    def demo_model_dir(self) -> Path:
        return self.data_dir / "models" / "tiny-llama"

    def set_model(self, path: str, report: dict) -> None:
        self.model_path, self.model_report = path, report
        self.model_changed.emit(path)
