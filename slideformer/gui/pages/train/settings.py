"""The Train page's settings: a form over a :class:`~slideformer.engine.config.RunConfig`, presets, and the
terminal command that runs the same config.

The form holds a whole RunConfig (:attr:`RunSettings.base`); each widget edits one field and
every field without a widget (budget, betas, ...) keeps the value of the last preset. So the
config file the app writes is exactly what the form and the presets say, key for key.
"""
from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox,
                               QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QSpinBox, QToolButton, QVBoxLayout,
                               QWidget)

from slideformer.engine.api import RunConfig, dumps
from slideformer.gui.models.formatting import short_path
from slideformer.gui.models.presets import Preset, apply_preset, load_presets

CUSTOM = "Custom"


class LearningRateBox(QDoubleSpinBox):
    """A learning rate written as people write it (1e-05, 0.0003); the arrows halve and double."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setDecimals(12)
        self.setRange(1e-9, 1.0)

    def textFromValue(self, value: float) -> str:
        return f"{value:.3g}"

    def valueFromText(self, text: str) -> float:
        try:
            return float(text)
        except ValueError:
            return self.value()

    def validate(self, text, pos):
        from PySide6.QtGui import QValidator
        try:
            float(text)
            return QValidator.State.Acceptable, text, pos
        except ValueError:
            return QValidator.State.Intermediate, text, pos

    def stepBy(self, steps: int) -> None:
        self.setValue(self.value() * 2.0 ** steps)


def spin(lo: int, hi: int, special: str = "") -> QSpinBox:
    box = QSpinBox(minimum=lo, maximum=hi)
    if special:
        box.setSpecialValueText(special)  # shown for the minimum, which means "off"
    return box


def dspin(lo: float, hi: float, step: float, decimals: int, special: str = "") -> QDoubleSpinBox:
    box = QDoubleSpinBox(minimum=lo, maximum=hi, singleStep=step, decimals=decimals)
    if special:
        box.setSpecialValueText(special)
    return box


def narrow(combo: QComboBox) -> QComboBox:
    """Let ``combo`` be narrower than its longest item (the form sits in a narrow column)."""
    combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
    combo.setMinimumContentsLength(10)
    return combo


def cli_command(config_file: Path, resume: bool = False) -> str:
    """The terminal command that runs ``config_file`` (as a user would type it)."""
    args = ["slideformer", "train", "--config", str(config_file)] + (["--resume"] if resume else [])
    return shlex.join(args)


class RunSettings(QWidget):
    """Hyper-parameters, presets and the output folder of the next run."""

    changed = Signal()
    """A field changed (by the user or a preset)."""
    preset_applied = Signal(object)
    """A :class:`Preset` was applied (after ``changed``)."""
    suggest_requested = Signal()
    """The user asked for settings suggested for the chosen model and machine."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.presets = load_presets()
        self.base = RunConfig()
        self._updating = False

        self._build_preset()
        self._build_form(self._build_fields())
        self._connect_edits()
        self.show_config(self.base)

    def _build_preset(self) -> None:
        """The preset chooser and its note."""
        self.preset = QComboBox()
        self.preset.addItem(CUSTOM, None)
        for p in self.presets:
            self.preset.addItem(p.name, p)
        self.preset.activated.connect(self._preset_chosen)
        self.suggest_button = QToolButton()
        self.suggest_button.setText("Suggest for this model")
        self.suggest_button.setToolTip("Known-good first settings for the chosen model on the "
                                       "machine the Plan page plans for:\nthe method that fits, "
                                       "LoRA rank, learning rate, sequence length and batch "
                                       "(editable after)")
        self.suggest_button.clicked.connect(self.suggest_requested)
        self.preset_note = QLabel("")
        self.preset_note.setObjectName("hint")
        self.preset_note.setWordWrap(True)

    def _build_fields(self) -> QHBoxLayout:
        """One widget per RunConfig field the form edits; returns the run folder's row."""
        self.lr = LearningRateBox()
        self.schedule = QComboBox()
        for s in ("constant", "linear", "cosine"):
            self.schedule.addItem(s, s)
        self.warmup = spin(0, 1_000_000)
        self.warmup.setSuffix(" steps")
        self.epochs = dspin(0.01, 1000.0, 0.5, 2)
        self.max_steps = spin(0, 100_000_000, "by epochs")
        self.micro_batch = spin(1, 4096)
        self.grad_accum = spin(1, 4096)
        self.seq_len = spin(16, 1 << 20)
        self.seq_len.setSingleStep(128)
        self.seq_len.setSuffix(" tokens")
        self.clip = dspin(0.0, 1000.0, 0.1, 2, "off")
        self.weight_decay = dspin(0.0, 10.0, 0.01, 3)
        self.save_every = spin(0, 100_000_000, "at the end only")
        self.eval_every = spin(0, 100_000_000, "at the end only")
        self.patience = spin(0, 9999, "never")
        self.patience.setSuffix(" evals")
        self.keep_best = QCheckBox("keep, export it")
        self.tensorboard = QCheckBox("TensorBoard")
        self.device = QComboBox()
        for value, text in (("auto", "auto (GPU if there is one)"), ("cuda", "GPU (CUDA)"),
                            ("cpu", "CPU")):
            self.device.addItem(text, value)
        self.output = QLineEdit()
        browse = QToolButton()
        browse.setText("…")
        browse.setToolTip("Choose the run folder")
        browse.clicked.connect(self._browse_output)
        out_row = QHBoxLayout()
        out_row.setContentsMargins(0, 0, 0, 0)
        out_row.addWidget(self.output, 1)
        out_row.addWidget(browse)
        return out_row

    def _build_form(self, out_row: QHBoxLayout) -> None:
        """The form's rows, the method rows and the fields' tooltips."""
        form = QFormLayout(self)
        form.addRow("Preset", self.preset)
        suggest_row = QHBoxLayout()  # a row of its own: beside the preset it widens the column
        suggest_row.setContentsMargins(0, 0, 0, 0)
        suggest_row.addWidget(self.suggest_button)
        suggest_row.addStretch(1)
        form.addRow("", suggest_row)
        form.addRow(self.preset_note)
        for label, widget in (("Learning rate", self.lr), ("Schedule", self.schedule),
                              ("Warm-up", self.warmup), ("Epochs", self.epochs),
                              ("Steps", self.max_steps), ("Micro-batch", self.micro_batch),
                              ("Accumulation", self.grad_accum), ("Sequence length", self.seq_len),
                              ("Clip grad norm", self.clip), ("Weight decay", self.weight_decay),
                              ("Checkpoint every", self.save_every),
                              ("Validate every", self.eval_every),
                              ("Stop early after", self.patience), ("Best checkpoint", self.keep_best),
                              ("Also report to", self.tensorboard), ("Device", self.device)):
            form.addRow(label, widget)
        form.addRow("Run folder", out_row)
        self._add_method_rows(form)
        self.max_steps.setToolTip("Optimizer steps; \"by epochs\" runs the epochs above")
        self.micro_batch.setToolTip("Sequences per micro-batch")
        self.grad_accum.setToolTip("Micro-batches per optimizer step")
        self.save_every.setToolTip("Write a checkpoint (resumable) every N steps")
        self.eval_every.setToolTip("Validation loss every N steps (needs a validation split)")
        self.patience.setToolTip("Stop when this many evaluations in a row did not lower the "
                                 "validation loss\n(train.early_stopping_patience; needs "
                                 "\"Validate every\")")
        self.keep_best.setToolTip("Keep the checkpoint with the lowest validation loss and export "
                                  "it as final/ (output.keep_best; needs \"Validate every\")")
        self.tensorboard.setToolTip("Also write the metrics for TensorBoard into the run folder's "
                                    "tensorboard/ (output.report_to; needs the tensorboard "
                                    "package)")

    def _connect_edits(self) -> None:
        """Every field's change is an edit; the combo boxes fit the narrow column."""
        for w in (self.lr, self.warmup, self.epochs, self.max_steps, self.micro_batch,
                  self.grad_accum, self.seq_len, self.clip, self.weight_decay, self.save_every,
                  self.eval_every, self.patience):
            w.valueChanged.connect(self._edited)
        for w in (self.keep_best, self.tensorboard):
            w.toggled.connect(self._edited)
        for w in (self.schedule, self.device, self.method):
            w.currentIndexChanged.connect(self._edited)
        for w in (self.rank, self.alpha, self.dropout, self.beta):
            w.valueChanged.connect(self._edited)
        self.objective.currentIndexChanged.connect(self._edited)
        narrow(self.objective)
        self.output.textChanged.connect(self._edited)
        self.targets.textChanged.connect(self._edited)
        self.merged.toggled.connect(self._edited)
        for combo in (self.preset, self.schedule, self.device, self.method):
            narrow(combo)
        self.preset.setMinimumContentsLength(16)

    def _add_method_rows(self, form: QFormLayout) -> None:
        """Method (full / LoRA / QLoRA) and the adapter settings, PEFT's names and defaults."""
        self.method = QComboBox()
        for value, text in (("full", "full fine-tuning"), ("lora", "LoRA (frozen bf16 base)"),
                            ("qlora", "QLoRA (frozen 4-bit NF4 base)")):
            self.method.addItem(text, value)
        self.rank = spin(1, 4096)
        self.alpha = dspin(0.01, 100_000.0, 1.0, 2)
        self.dropout = dspin(0.0, 0.99, 0.05, 2, "off")
        self.targets = QLineEdit()
        self.merged = QCheckBox("merged model")
        self.merged.setToolTip("Besides the adapter folder (final/, which PEFT loads onto the "
                               "base), write final-merged/:\nthe base with the adapters folded "
                               "in, a plain Hugging Face model (lora.export_merged)")
        self.method.setToolTip("LoRA / QLoRA train small adapters over a frozen base: "
                               "the only way to fit 70B-class models in host RAM")
        self.rank.setToolTip("lora.rank (PEFT's r)")
        self.alpha.setToolTip("lora.alpha: adapters are scaled by alpha / rank")
        self.targets.setToolTip("Comma-separated projections with adapters (PEFT's target_modules)")
        form.addRow("Method", self.method)
        self.objective = QComboBox()
        for value, text in (("sft", "supervised (SFT)"), ("dpo", "DPO (pairs)"),
                            ("orpo", "ORPO (pairs)"), ("simpo", "SimPO (pairs)"),
                            ("kto", "KTO (labelled)"), ("grpo", "GRPO (sampled replies)")):
            self.objective.addItem(text, value)
        self.objective.setToolTip("train.objective: the next-token loss, or a preference "
                                  "objective on {\"prompt\", \"chosen\", \"rejected\"} "
                                  "records\n(the micro-batch then counts pairs), or GRPO on "
                                  "prompts with an \"answer\" (replies sampled and checked;\n"
                                  "the micro-batch counts replies, grpo.group_size of them a "
                                  "prompt; a reward file is set in the run's TOML, [grpo])")
        self.beta = dspin(0.001, 1000.0, 0.05, 3)
        self.beta.setToolTip("preference.beta: DPO's, SimPO's and KTO's beta, ORPO's lambda")
        form.addRow("Objective", self.objective)
        form.addRow("Preference beta", self.beta)
        for label, widget in (("LoRA rank", self.rank), ("LoRA alpha", self.alpha),
                              ("LoRA dropout", self.dropout), ("LoRA targets", self.targets),
                              ("Also write", self.merged)):
            form.addRow(label, widget)

    def _show_method(self, cfg: RunConfig) -> None:
        lo = cfg.lora
        self.method.setCurrentIndex(self.method.findData(cfg.train.method))
        self.rank.setValue(lo.rank)
        self.alpha.setValue(lo.alpha)
        self.dropout.setValue(lo.dropout)
        self.targets.setText(lo.target_modules)
        self.merged.setChecked(lo.export_merged)
        self._enable_lora(cfg.train.method)
        self.objective.setCurrentIndex(self.objective.findData(cfg.train.objective))
        self.beta.setValue(cfg.preference.beta)
        self.beta.setEnabled(cfg.train.objective not in ("sft", "grpo"))

    def _enable_lora(self, method: str) -> None:
        for w in (self.rank, self.alpha, self.dropout, self.targets, self.merged):
            w.setEnabled(method != "full")

    # ---- the config ------------------------------------------------------------------------
    def config(self) -> RunConfig:
        """The RunConfig the form describes (model and data come from the other pages)."""
        b = self.base
        return replace(
            b,
            data=replace(b.data, max_seq_len=self.seq_len.value()),
            optim=replace(b.optim, lr=self.lr.value(), schedule=self.schedule.currentData(),
                          warmup_steps=self.warmup.value(), max_grad_norm=self.clip.value(),
                          weight_decay=self.weight_decay.value()),
            train=replace(b.train, epochs=self.epochs.value(), max_steps=self.max_steps.value(),
                          micro_batch=self.micro_batch.value(),
                          grad_accum=self.grad_accum.value(), save_every=self.save_every.value(),
                          eval_every=self.eval_every.value(), device=self.device.currentData(),
                          method=self.method.currentData(),
                          early_stopping_patience=self.patience.value(),
                          objective=self.objective.currentData()),
            preference=replace(b.preference, beta=self.beta.value()),
            lora=replace(b.lora, rank=self.rank.value(), alpha=self.alpha.value(),
                         dropout=self.dropout.value(), target_modules=self.targets.text().strip(),
                         export_merged=self.merged.isChecked()),
            output=replace(b.output, run_dir=self.output.text().strip(),
                           keep_best=self.keep_best.isChecked(), report_to=self._report_to()))

    def _report_to(self) -> tuple[str, ...]:
        """output.report_to with TensorBoard as the box says (other trackers kept as given)."""
        others = tuple(t for t in self.base.output.report_to if t != "tensorboard")
        return ("tensorboard",) * self.tensorboard.isChecked() + others

    def show_config(self, cfg: RunConfig) -> None:
        """Show every field of ``cfg`` that has a widget (no ``changed`` signals meanwhile)."""
        self._updating = True
        self.base = cfg
        o, t = cfg.optim, cfg.train
        self.lr.setValue(o.lr)
        self.schedule.setCurrentIndex(self.schedule.findData(o.schedule))
        self.warmup.setValue(o.warmup_steps)
        self.epochs.setValue(t.epochs)
        self.max_steps.setValue(t.max_steps)
        self.micro_batch.setValue(t.micro_batch)
        self.grad_accum.setValue(t.grad_accum)
        self.seq_len.setValue(cfg.data.max_seq_len)
        self.clip.setValue(o.max_grad_norm)
        self.weight_decay.setValue(o.weight_decay)
        self.save_every.setValue(t.save_every)
        self.eval_every.setValue(t.eval_every)
        self.patience.setValue(t.early_stopping_patience)
        self.keep_best.setChecked(cfg.output.keep_best)
        self.tensorboard.setChecked("tensorboard" in cfg.output.report_to)
        self.device.setCurrentIndex(self.device.findData(t.device))
        self.output.setText(cfg.output.run_dir)
        self.epochs.setEnabled(t.max_steps == 0)
        self._show_method(cfg)
        self._updating = False

    def apply_preset(self, preset: Preset) -> None:
        self.show_config(apply_preset(self.config(), preset))
        self.preset.setCurrentIndex(self.preset.findText(preset.name))
        self.preset_note.setText(preset.description)
        self.changed.emit()
        self.preset_applied.emit(preset)

    def show_suggestion(self, preset: Preset) -> None:
        """Apply a suggestion, listed under the presets (one at a time) so it can be chosen
        again after an edit."""
        if self.preset.count() > 1 and self.preset.itemData(1) is not None \
                and self.preset.itemData(1) not in self.presets:
            self.preset.removeItem(1)
        self.preset.insertItem(1, preset.name, preset)
        self.apply_preset(preset)

    def is_untouched(self) -> bool:
        """Whether the form still holds the defaults (nothing chosen or edited yet)."""
        default = RunConfig()
        return replace(self.config(), output=default.output, data=default.data) == default \
            and self.seq_len.value() == default.data.max_seq_len

    def _preset_chosen(self, index: int) -> None:
        preset = self.preset.itemData(index)
        if preset is not None:
            self.apply_preset(preset)

    def _edited(self) -> None:
        if self._updating:
            return
        self.base = self.config()
        self.epochs.setEnabled(self.max_steps.value() == 0)
        self._enable_lora(self.base.train.method)
        self.beta.setEnabled(self.base.train.objective not in ("sft", "grpo"))
        if self.preset.currentData() is not None and not self._matches(self.preset.currentData()):
            self.preset.setCurrentIndex(0)
            self.preset_note.setText("")
        self.changed.emit()

    def _matches(self, preset: Preset) -> bool:
        return apply_preset(self.base, preset) == self.base

    def _browse_output(self) -> None:
        start = str(Path(self.output.text()).parent) if self.output.text() else str(Path.home())
        path = QFileDialog.getExistingDirectory(self, "Choose a folder for the run", start)
        if path:
            self.output.setText(path)


class CommandDialog(QDialog):
    """The terminal command equivalent to Start, and the config file it reads."""

    def __init__(self, config_file: Path, toml: str, resume: bool = False, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Run from a terminal")
        self.command = QLineEdit(cli_command(config_file, resume))
        self.command.setReadOnly(True)
        self.command.setCursorPosition(0)
        copy = QPushButton("Copy")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.command.text()))
        row = QHBoxLayout()
        row.addWidget(self.command, 1)
        row.addWidget(copy)
        text = QPlainTextEdit(toml)
        text.setReadOnly(True)
        text.setMinimumSize(560, 320)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        note = QLabel(f"The same run from a terminal: the app wrote its settings to "
                      f"{short_path(config_file)}. The command trains exactly what Start "
                      f"trains; the app can follow it from the Runs page.")
        note.setWordWrap(True)
        lay.addWidget(note)
        lay.addLayout(row)
        lay.addWidget(text, 1)
        lay.addWidget(buttons)


def write_config(cfg: RunConfig, path: Path) -> Path:
    """Write ``cfg`` as the TOML file ``slideformer train --config`` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(cfg), encoding="utf-8")
    return path
