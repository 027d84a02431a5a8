"""What the app remembers between sessions: window layout, theme, recent model folders, the
folders searched for models, run folders added to the Runs page.

A thin typed layer over ``QSettings`` (organisation "SlideFormer", application "SlideFormer
Studio"). Tests pass a ``QSettings`` on a file of their own.
"""
from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings

ORGANISATION = "SlideFormer"
APPLICATION = "SlideFormer Studio"
MAX_RECENT = 10
THEMES = ("light", "dark")


class Settings:
    """Typed access to the app's ``QSettings``."""

    def __init__(self, qsettings: QSettings | None = None):
        self.q = qsettings if qsettings is not None else QSettings(ORGANISATION, APPLICATION)

    # ---- recent models -------------------------------------------------------------------
    def recent_models(self) -> list[str]:
        """Model folders, most recent first."""
        value = self.q.value("models/recent", [])
        if isinstance(value, str):  # QSettings returns a lone string for a one-item list
            value = [value]
        return [str(v) for v in value or []]

    def add_recent_model(self, path: str) -> list[str]:
        """Put ``path`` first in the recent list (no duplicates, at most MAX_RECENT)."""
        recent = [path] + [p for p in self.recent_models() if p != path]
        recent = recent[:MAX_RECENT]
        self.q.setValue("models/recent", recent)
        return recent

    def remove_recent_model(self, path: str) -> list[str]:
        recent = [p for p in self.recent_models() if p != path]
        self.q.setValue("models/recent", recent)
        return recent

    def model_folders(self) -> list[str]:
        """Folders the user added to the Model page's search for models on this machine."""
        value = self.q.value("models/folders", [])
        if isinstance(value, str):
            value = [value]
        return [str(v) for v in value or []]

    def add_model_folder(self, path: str) -> list[str]:
        folders = self.model_folders() + ([path] if path not in self.model_folders() else [])
        self.q.setValue("models/folders", folders)
        return folders

    def remove_model_folder(self, path: str) -> list[str]:
        folders = [p for p in self.model_folders() if p != path]
        self.q.setValue("models/folders", folders)
        return folders

    # ---- runs ----------------------------------------------------------------------------
    def extra_runs(self) -> list[str]:
        """Run folders outside the app's runs folder that the Runs page lists."""
        value = self.q.value("runs/extra", [])
        if isinstance(value, str):
            value = [value]
        return [str(v) for v in value or []]

    def add_extra_run(self, path: str) -> None:
        if path not in self.extra_runs():
            self.q.setValue("runs/extra", self.extra_runs() + [path])

    # ---- appearance ----------------------------------------------------------------------
    def theme(self) -> str:
        value = str(self.q.value("view/theme", "light"))
        return value if value in THEMES else "light"

    def set_theme(self, name: str) -> None:
        self.q.setValue("view/theme", name)

    # ---- window --------------------------------------------------------------------------
    def window_geometry(self) -> QByteArray | None:
        return self.q.value("window/geometry")

    def window_state(self) -> QByteArray | None:
        return self.q.value("window/state")

    def save_window(self, geometry: QByteArray, state: QByteArray) -> None:
        self.q.setValue("window/geometry", geometry)
        self.q.setValue("window/state", state)

    def monitor_collapsed(self) -> bool:
        """The Monitor dock was folded to a strip when the app last closed."""
        return str(self.q.value("window/monitor_collapsed", "false")).lower() == "true"

    def set_monitor_collapsed(self, collapsed: bool) -> None:
        self.q.setValue("window/monitor_collapsed", "true" if collapsed else "false")

    def sync(self) -> None:
        self.q.sync()
