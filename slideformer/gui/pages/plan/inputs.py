"""The Plan page's inputs: the machine to plan for and its budgets, and the shape of the run.

:func:`detect_machine` asks the planner what the target (this machine, or a GPU preset) has
(NVML and psutil here, the preset's figures otherwise) and what ``auto`` budgets it would take. :class:`PlanInputs` shows that and holds the
settings the planner varies, each widget bound to one run-config key in one table
(:meth:`PlanInputs.settings` reads them all, :meth:`PlanInputs.apply` sets any of them, e.g. a
fix's ``settings``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QBoxLayout, QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog,
                               QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QSlider, QSpinBox, QWidget)

from slideformer.engine.api import BudgetConfig, Budgets, GpuMemory, HardwareProfile, HostMemory, \
    RunConfig, UserError, gpu_memory, host_memory, load_profile, parse_bytes, resolve_budgets, \
    run_device
from slideformer.gui.models.fit import METHODS, targets
from slideformer.gui.models.formatting import human_bytes

GiB = 1 << 30
CHECKPOINTS = (("auto", "auto (fastest that fits)"), ("gpu", "on the GPU"),
               ("host", "in host RAM (pinned)"))
MOMENTS = (("float32", "float32 (exact)"), ("bfloat16", "bfloat16 (half the memory)"),
           ("int8", "8-bit blocks (a quarter of the memory)"))
PRECISIONS = (("bf16", "bf16 (least activation memory)"),
              ("autocast", "autocast (fp32 residual stream, closest to fp32)"),
              ("fp8", "FP8 projections (GPUs with FP8 only)"))


@dataclass(frozen=True)
class Machine:
    """What the planner sees of this machine."""
    gpu: GpuMemory | None
    """GPU 0 through NVML; None without an NVIDIA GPU."""
    host: HostMemory
    profile: HardwareProfile
    """Speeds the plan predicts with (this machine's, measured or assumed, or a preset's)."""
    device: str
    """cuda or cpu: the backend a run would use."""
    auto: Budgets | None
    """The budgets ``auto`` means here; None when they leave nothing (``auto_error`` says why)."""
    auto_error: str = ""

    @property
    def vram_total(self) -> int | None:
        return self.gpu.total if self.gpu else self.profile.vram_total


def detect_machine(target: str = "this") -> Machine:
    """``target`` (``this`` or a GPU preset key) as the planner sees it (reads NVML and psutil:
    call off the GUI thread)."""
    profile = load_profile(target)
    gpu, host = (None if profile.preset else gpu_memory()), host_memory()
    device = run_device(RunConfig(), profile)
    try:
        return Machine(gpu, host, profile, device,
                       resolve_budgets(BudgetConfig(), device, profile, gpu, host))
    except UserError as e:
        return Machine(gpu, host, profile, device, None, str(e))


def _gib_floor(n: int) -> float:
    """Bytes as GiB with one decimal, rounded down (a budget never above what is there)."""
    return math.floor(n / GiB * 10) / 10


def _gib_text(value: float) -> str:
    return f"{value:g}GiB"


class GibBudget(QWidget):
    """A budget in GiB: a slider up to what the machine has, and a box to type any size."""

    changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.box = QDoubleSpinBox(decimals=1, minimum=0.5, maximum=65536.0, suffix=" GiB")
        self.box.setSingleStep(1.0)
        self.box.setKeyboardTracking(False)
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(1, 2)
        self.slider.valueChanged.connect(lambda v: self.box.setValue(v / 2))  # half-GiB steps
        self.box.valueChanged.connect(self._box_changed)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.slider, 1)
        lay.addWidget(self.box)

    def _box_changed(self, value: float) -> None:
        self.slider.blockSignals(True)
        self.slider.setValue(round(value * 2))
        self.slider.blockSignals(False)
        self.changed.emit()

    def set_range(self, top_gib: float, box_max: float | None = None) -> None:
        """Slider up to ``top_gib``; the box up to ``box_max`` (default: the same)."""
        self.slider.setRange(1, max(2, int(top_gib * 2)))
        self.box.setMaximum(box_max if box_max is not None else top_gib)

    def value(self) -> float:
        return self.box.value()

    def set_value(self, gib: float) -> None:
        self.box.setValue(gib)


class PowerOfTwoSpin(QSpinBox):
    """A count whose arrows double and halve it (sequence lengths); any value can be typed."""

    def stepBy(self, steps: int) -> None:
        v = self.value()
        for _ in range(abs(steps)):  # to the next power of two up or down: 3000 -> 4096 / 2048
            v = 1 << v.bit_length() if steps > 0 else 1 << max(0, (v - 1).bit_length() - 1)
        self.setValue(v)


class PlanInputs(QWidget):
    """Budgets and run shape; ``changed`` fires on every edit."""

    changed = Signal()
    find_max_batch = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.machine: Machine | None = None
        defaults = RunConfig()
        self._clip_norm = defaults.optim.max_grad_norm if defaults.optim.max_grad_norm > 0 else 1.0

        self._boxes = QBoxLayout(QBoxLayout.Direction.LeftToRight, self)
        self._boxes.setContentsMargins(0, 0, 0, 0)
        self._boxes.addWidget(self._build_machine_box(), 1)
        self._boxes.addWidget(self._build_run_box(defaults), 1)
        self._bind_fields(defaults)

    def _build_machine_box(self) -> QGroupBox:
        """The machine to plan for, what it has, and the budgets of each memory tier."""
        self.target = QComboBox()
        for name, key in targets():
            self.target.addItem(name, key)
        self.target.setToolTip("Plan for this machine, or for a GPU you may buy or rent (its "
                               "vendor figures; type the RAM and disk of its host below)")
        self.detected = QLabel("Detecting this machine…")
        self.detected.setObjectName("hint")
        self.detected.setWordWrap(True)
        self.vram, self.ram = GibBudget(), GibBudget()
        self.nvme_dir = QLineEdit()
        self.nvme_dir.setPlaceholderText("none (optional)")
        self.nvme_dir.setClearButtonEnabled(True)
        browse = QPushButton("Choose…")
        browse.clicked.connect(self._choose_nvme)
        nvme_row = QHBoxLayout()
        nvme_row.addWidget(self.nvme_dir, 1)
        nvme_row.addWidget(browse)
        self.nvme_size = QDoubleSpinBox(decimals=0, minimum=0, maximum=1 << 20, suffix=" GiB")
        self.nvme_size.setSpecialValueText("its free space")
        self.nvme_size.setKeyboardTracking(False)
        self.reset_button = QPushButton("Reset")
        self.reset_button.setToolTip("Set the GPU and RAM budgets to what this machine has free, "
                                     "less a safety margin")
        self.reset_button.clicked.connect(self.reset_budgets)

        detected_row = QHBoxLayout()
        detected_row.addWidget(self.detected, 1)
        detected_row.addWidget(self.reset_button, 0, Qt.AlignmentFlag.AlignTop)
        machine_box = QGroupBox("Machine and budgets")
        form = QFormLayout(machine_box)
        form.addRow("Plan for", self.target)
        form.addRow(detected_row)
        form.addRow("GPU memory", self.vram)
        form.addRow("Host RAM", self.ram)
        form.addRow("NVMe folder", nvme_row)
        form.addRow("NVMe budget", self.nvme_size)
        return machine_box

    def _build_run_box(self, defaults: RunConfig) -> QGroupBox:
        """The method and the shape of the run: sequence, batch, checkpoints, slots, precision."""
        self.seq_len = PowerOfTwoSpin(minimum=8, maximum=1 << 20)
        self.seq_len.setValue(defaults.data.max_seq_len)
        self.micro_batch = QSpinBox(minimum=1, maximum=1 << 16)
        self.micro_batch.setValue(defaults.train.micro_batch)
        self.max_button = QPushButton("Find max batch")
        self.max_button.setToolTip("Set the micro-batch to the largest that fits these budgets")
        self.max_button.setEnabled(False)
        self.max_button.clicked.connect(self.find_max_batch)
        mb_row = QHBoxLayout()
        mb_row.addWidget(self.micro_batch, 1)
        mb_row.addWidget(self.max_button)
        self.grad_accum = QSpinBox(minimum=1, maximum=1 << 16)
        self.grad_accum.setValue(defaults.train.grad_accum)
        self.checkpoints = QComboBox()
        for key, text in CHECKPOINTS:
            self.checkpoints.addItem(text, key)
        self.slots = QSpinBox(minimum=0, maximum=4096)
        self.slots.setSpecialValueText("auto (as many as fit)")
        self.slots.setToolTip("Decoder layers held on the GPU at once (at least 2)")
        self.gpu_layers = QSpinBox(minimum=-1, maximum=4096)
        self.gpu_layers.setSpecialValueText("auto (spare VRAM)")
        self.gpu_layers.setToolTip("Decoder layers whose master weights and moments stay on the GPU "
                                   "and are updated there, with the embedding and head (0: all "
                                   "optimizer work on the CPU)")
        self.moments = QComboBox()
        for key, text in MOMENTS:
            self.moments.addItem(text, key)
        self.moments.setToolTip("Format of the AdamW moments m and v: bfloat16 and 8-bit blocks "
                                "(6 bytes a parameter with the weights) change the numerics "
                                "slightly")
        self.precision = QComboBox()
        for key, text in PRECISIONS:
            self.precision.addItem(text, key)
        self.precision.setToolTip("train.precision with bf16 compute: bf16 keeps the hidden states "
                                  "in bf16; autocast keeps them in fp32 (torch.autocast's "
                                  "numerics, twice the checkpoint memory); FP8 runs the "
                                  "feed-forward's projections in row-wise FP8 (further from "
                                  "fp32, not faster yet; RTX 40xx, L4/L40, H100/H200, B200 "
                                  "only)")
        self.clip = QCheckBox("Gradient clipping")
        self.clip.setToolTip("Exact global-norm clipping. Off: the CPU updates overlap the "
                             "backward instead of the next forward")
        for box in (self.seq_len, self.micro_batch, self.grad_accum, self.slots, self.gpu_layers):
            box.setKeyboardTracking(False)
        precision = QHBoxLayout()
        precision.addWidget(self.clip)
        precision.addStretch(1)

        self.method = QComboBox()
        for key, text in METHODS:
            self.method.addItem(text, key)
        self.method.setToolTip("Full fine-tuning trains every weight; LoRA and QLoRA train small "
                               "adapters over a frozen base (bf16, or 4-bit NF4)")
        run_box = QGroupBox("Run")
        run = QFormLayout(run_box)
        run.addRow("Method", self.method)
        run.addRow("Sequence length", self.seq_len)
        run.addRow("Micro-batch", mb_row)
        run.addRow("Accumulation", self.grad_accum)
        run.addRow("Checkpoints", self.checkpoints)
        run.addRow("Layer slots", self.slots)
        run.addRow("GPU-updated layers", self.gpu_layers)
        run.addRow("AdamW moments", self.moments)
        run.addRow("Precision", self.precision)
        run.addRow(precision)
        return run_box

    def _bind_fields(self, defaults: RunConfig) -> None:
        """Bind every input to its run-config key, start from the defaults, and signal edits."""
        # Every input, as the run-config key it sets: (read it, set it from a config value).
        self._fields = {
            "budget.vram": (self._vram_text, lambda v: self.vram.set_value(parse_bytes(v) / GiB)),
            "budget.ram": (lambda: _gib_text(self.ram.value()),
                           lambda v: self.ram.set_value(parse_bytes(v) / GiB)),
            "budget.nvme_dir": (lambda: self.nvme_dir.text().strip(), self.nvme_dir.setText),
            "budget.nvme_size": (self._nvme_size_text, self._set_nvme_size),
            "train.method": (self.method.currentData,
                             lambda v: self.method.setCurrentIndex(self.method.findData(v))),
            "data.max_seq_len": (self.seq_len.value, self.seq_len.setValue),
            "train.micro_batch": (self.micro_batch.value, self.micro_batch.setValue),
            "train.grad_accum": (self.grad_accum.value, self.grad_accum.setValue),
            "budget.checkpoints": (self.checkpoints.currentData,
                                   lambda v: self.checkpoints.setCurrentIndex(
                                       self.checkpoints.findData(v))),
            "budget.slots": (self.slots.value, self.slots.setValue),
            "budget.gpu_layers": (self.gpu_layers.value, self.gpu_layers.setValue),
            "optim.moments_dtype": (self.moments.currentData,
                                    lambda v: self.moments.setCurrentIndex(self.moments.findData(v))),
            "train.precision": (self.precision.currentData,
                                lambda v: self.precision.setCurrentIndex(
                                    self.precision.findData(v))),
            "optim.max_grad_norm": (lambda: self._clip_norm if self.clip.isChecked() else 0.0,
                                    lambda v: self.clip.setChecked(float(v) > 0)),
        }
        self.set_settings({"optim.moments_dtype": defaults.optim.moments_dtype,
                           "train.precision": defaults.train.precision,
                           "optim.max_grad_norm": defaults.optim.max_grad_norm,
                           "budget.checkpoints": defaults.budget.checkpoints,
                           "budget.slots": defaults.budget.slots,
                           "budget.gpu_layers": defaults.budget.gpu_layers,
                           "train.method": defaults.train.method})
        for signal in (self.vram.changed, self.ram.changed, self.nvme_dir.editingFinished,
                       self.nvme_size.valueChanged, self.method.currentIndexChanged,
                       self.seq_len.valueChanged,
                       self.micro_batch.valueChanged, self.grad_accum.valueChanged,
                       self.checkpoints.currentIndexChanged, self.slots.valueChanged,
                       self.gpu_layers.valueChanged, self.moments.currentIndexChanged,
                       self.precision.currentIndexChanged, self.clip.toggled):
            signal.connect(self.changed)

    def set_stacked(self, stacked: bool) -> None:
        """The two boxes one above the other (a narrow column), or side by side."""
        self._boxes.setDirection(QBoxLayout.Direction.TopToBottom if stacked
                                 else QBoxLayout.Direction.LeftToRight)

    # ---- the run-config keys ------------------------------------------------------------------
    def settings(self) -> dict[str, object]:
        """Every input as ``{"train.micro_batch": 4, ...}`` (slideformer.engine.config.override takes it)."""
        return {key: get() for key, (get, _) in self._fields.items()}

    def can_apply(self, settings) -> bool:
        """Whether every key of ``settings`` has an input here."""
        return all(key in self._fields for key in dict(settings))

    def apply(self, settings) -> None:
        """Set the inputs of ``settings`` (config key -> value), then one ``changed``."""
        self.set_settings(settings)
        self.changed.emit()

    def set_settings(self, settings) -> None:
        """Set inputs without signalling (the caller asks for the plan it wants)."""
        blocked = [w.blockSignals(True) for w in self._signalling()]
        try:
            for key, value in dict(settings).items():
                self._fields[key][1](value)
        finally:
            for w, was in zip(self._signalling(), blocked):
                w.blockSignals(was)

    def _signalling(self) -> list[QWidget]:
        return [self.vram, self.ram, self.nvme_dir, self.nvme_size, self.method, self.seq_len,
                self.micro_batch, self.grad_accum, self.checkpoints, self.slots, self.gpu_layers,
                self.moments, self.precision, self.clip]

    def _vram_text(self) -> str:
        if self.machine is not None and self.machine.device != "cuda":
            return "auto"  # the CPU backend has no GPU budget
        return _gib_text(self.vram.value())

    def _nvme_size_text(self) -> str:
        if not self.nvme_dir.text().strip():
            return "0"
        return "auto" if self.nvme_size.value() == 0 else _gib_text(self.nvme_size.value())

    def _set_nvme_size(self, value: str) -> None:
        auto = str(value).strip().lower() in ("", "0", "auto")
        self.nvme_size.setValue(0 if auto else parse_bytes(value) / GiB)

    def _choose_nvme(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Folder on the NVMe disk",
                                                self.nvme_dir.text())
        if path:
            self.nvme_dir.setText(path)
            self.changed.emit()

    # ---- the machine ------------------------------------------------------------------------
    def set_machine(self, machine: Machine) -> None:
        """Show what the machine has, bound the budgets by it, and start from its budgets."""
        self.machine = machine
        gpu, host, profile = machine.gpu, machine.host, machine.profile
        if profile.preset:
            gpu_text = (f"GPU: {profile.gpu}, {human_bytes(profile.vram_total)} (vendor "
                        f"figures). Give the RAM of the machine it sits in.")
        elif gpu is not None:
            gpu_text = f"GPU: {gpu.name}, {human_bytes(gpu.total)} ({human_bytes(gpu.free)} free)"
        else:
            gpu_text = "No NVIDIA GPU here: the run would use the CPU backend."
        lines = [gpu_text, f"RAM here: {human_bytes(host.total)} ({human_bytes(host.available)} "
                           f"available)"]
        if machine.auto_error:
            lines.append(machine.auto_error)
        self.detected.setText("\n".join(lines))
        total = machine.vram_total
        self.vram.setEnabled(machine.device == "cuda" and total is not None)
        blocked = [w.blockSignals(True) for w in (self.vram, self.ram)]
        if total is not None:
            self.vram.set_range(_gib_floor(total))
        self.ram.set_range(_gib_floor(host.total), box_max=65536.0)  # plan for a bigger host too
        for w, was in zip((self.vram, self.ram), blocked):
            w.blockSignals(was)
        if machine.auto is not None:
            self.vram.setToolTip(f"Detected budget: {machine.auto.vram_source}")
            self.ram.setToolTip(f"Detected budget: {machine.auto.ram_source}")
        self.set_settings(self._detected_budgets())

    def _detected_budgets(self) -> dict[str, str]:
        auto, m = self.machine.auto, self.machine
        if auto is not None:
            vram = _gib_floor(auto.vram) if auto.vram else 0.5
            return {"budget.vram": _gib_text(vram), "budget.ram": _gib_text(_gib_floor(auto.ram))}
        vram = _gib_floor(m.vram_total) if m.vram_total else 0.5
        return {"budget.vram": _gib_text(vram), "budget.ram": _gib_text(_gib_floor(m.host.total))}

    def reset_budgets(self) -> None:
        if self.machine is not None:
            self.apply(self._detected_budgets())
