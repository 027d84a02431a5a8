"""The Data page: choose a dataset, see what the model will be trained on.

Every figure comes from the engine (:func:`slideformer.engine.api.analyse_data`), run on a worker thread
with the chosen model's tokenizer and chat template: the detected format, record and token
counts, truncation, the validation split, the
record-length histogram, and the first records as the model sees them, with the tokens that carry
a loss marked. The preview reads only the first records, so it shows within a fraction of a second
whatever the file's size, before the whole file is tokenised (a refused record, too, shows its
message then). Tokenising fills the same cache the run reads, so Start does not tokenise again.
The settings here are the run's ``[data]`` section (:meth:`AppContext.set_data_config`).

A file of preference pairs (TRL's prompt, chosen, rejected) or of GRPO's prompts (a prompt and
its answer), which supervised fine-tuning refuses, is shown as ``slideformer data inspect
--pairs`` / ``--prompts`` shows it: its counts, and the first pairs with their responses marked
as trained text is, or the first prompts as the model reads them with their answers. The page
knows which from the file's first record; the settings that do not apply are hidden.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QFrame, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QProgressBar,
                               QPushButton, QScrollArea, QSpinBox, QTextBrowser, QVBoxLayout,
                               QWidget)

from slideformer.engine.api import FORMATS, DataConfig, Preview
from slideformer.gui.context import AppContext
from slideformer.gui.models.formatting import home_relative, short_path
from slideformer.gui.pages.data_report import (SUMMARY_ROWS, VIEWS, AnalysisProgress,
                                               DataReport, PairsReport, PromptsReport, analyse,
                                               dropped_file, kind_line, make_demo_dataset,
                                               pairs_html, pairs_summary, prompts_html,
                                               prompts_summary, sample_html, sft_summary)
from slideformer.gui.pages.train.settings import narrow
from slideformer.gui.theme import PLOT_COLORS
from slideformer.gui.widgets.common import action_row, page_header, set_state, status_label
from slideformer.gui.widgets.histogram import LengthHistogram
from slideformer.gui.workers.thread import run_task

DEBOUNCE_MS = 300
"""A setting changed: wait this long for the next change before preparing the data again."""
LEFT_COLUMN_PX = 380
FILE_FILTER = ("Datasets (*.jsonl *.json *.txt *.csv *.parquet *.arrow *.feather);;"
               "All files (*)")
FORMAT_NAMES = {"auto": "auto-detect", "text": "plain text", "alpaca": "Alpaca (instruction / "
                "output)", "messages": "chat (OpenAI messages)", "sharegpt": "chat (ShareGPT)"}
VALIDATION_MODES = ("none", "fraction", "file")
TEMPLATE_FILE = "\0file"
"""The chat-template entry that asks for a .jinja file."""


class DataPage(QWidget):
    """Dataset file, its [data] settings, and what the engine makes of it."""

    analysed = Signal(object)
    """A report for the current settings arrived: a :class:`DataReport` (SFT data), a
    :class:`PairsReport` or a :class:`PromptsReport`."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setAcceptDrops(True)
        self.report: DataReport | PairsReport | PromptsReport | None = None
        self.kind = "sft"
        """How the file is read: "sft", "pairs" or "prompts" (records_kind)."""
        self._wanted: DataConfig | None = None
        """The settings being prepared; answers for any other settings are stale."""
        self._progress = AnalysisProgress(self)
        self._progress.changed.connect(self._on_progress)
        self._progress.read_as.connect(self._on_kind)
        self._progress.previewed.connect(self._on_preview)
        self._debounce = QTimer(self, singleShot=True, interval=DEBOUNCE_MS)
        self._debounce.timeout.connect(self.analyse)

        actions = self._build_actions()
        self.file_label = QLabel("")
        self.file_label.setObjectName("folder")
        self.file_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status = status_label()
        self._build_settings()
        self._build_summary()
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Data", "The training data: a JSONL/JSON, CSV, Parquet or "
                                          "Arrow file (text, Alpaca, chat messages or ShareGPT, "
                                          "with tool calls) or plain text. It is "
                                          "templated and tokenised with the model's own "
                                          "tokenizer, exactly as the run will see it."))
        lay.addLayout(actions)
        lay.addWidget(self.file_label)
        lay.addWidget(self.status)
        lay.addLayout(self._build_body(), 1)

        ctx.model_changed.connect(lambda _path: self.schedule())
        ctx.data_changed.connect(self._on_context_changed)
        ctx.theme_changed.connect(lambda name: self.set_colors(*PLOT_COLORS[name]))
        self.set_colors(*PLOT_COLORS[ctx.settings.theme()])
        self._show_config(ctx.data_config)
        self._show_idle()

    def _build_actions(self) -> QHBoxLayout:
        """Choose a file, or the demo dataset; the progress of the preparation at the end."""
        self.choose_button = QPushButton("Choose file…")
        self.choose_button.setObjectName("primary")
        self.choose_button.clicked.connect(self.choose_file)
        self.demo_button = QPushButton("Use demo dataset")
        self.demo_button.setToolTip("4,000 chat records of a letter-reversal task that the demo "
                                    "model learns in a minute, written into\n"
                                    f"{self.ctx.data_dir / 'datasets'}")
        self.demo_button.clicked.connect(self.use_demo)
        self.busy = QProgressBar()
        self.busy.setMaximumWidth(160)
        self.busy.setTextVisible(False)
        self.busy.hide()
        return action_row((self.choose_button, self.demo_button), "or drop a file here",
                          self.busy)

    def _build_results(self) -> QVBoxLayout:
        """The histogram of record lengths over the preview of the first records."""
        self.histogram = LengthHistogram()
        self.histogram.setMinimumHeight(120)
        self.hist_box = QGroupBox("Record lengths")
        QVBoxLayout(self.hist_box).addWidget(self.histogram)
        self.preview = QTextBrowser()
        self.preview.setOpenLinks(False)
        title, legend = VIEWS["sft"]
        self.legend = QLabel(legend)
        self.legend.setObjectName("hint")
        self.legend.setWordWrap(True)
        self.preview_box = QGroupBox(title)
        pv = QVBoxLayout(self.preview_box)
        pv.addWidget(self.legend)
        pv.addWidget(self.preview, 1)
        right = QVBoxLayout()
        right.addWidget(self.hist_box, 2)
        right.addWidget(self.preview_box, 3)
        return right

    def _build_body(self) -> QHBoxLayout:
        """Settings and summary in a scrolling column left of the results."""
        left_box = QWidget()
        left = QVBoxLayout(left_box)
        left.setContentsMargins(0, 0, 0, 0)
        left.addWidget(self.settings_box)
        left.addWidget(self.summary_box, 1)
        left_scroll = QScrollArea()  # a short window scrolls the settings, not the page
        left_scroll.setWidget(left_box)
        left_scroll.setWidgetResizable(True)
        left_scroll.setFrameShape(QFrame.Shape.NoFrame)
        left_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        left_scroll.setMinimumWidth(max(LEFT_COLUMN_PX, left_box.minimumSizeHint().width()
                                        + left_scroll.verticalScrollBar().sizeHint().width()))
        body = QHBoxLayout()
        body.addWidget(left_scroll, 0)
        body.addLayout(self._build_results(), 1)
        return body

    # ---- settings ----------------------------------------------------------------------------
    def _build_settings(self) -> None:
        d = DataConfig()
        self.format = QComboBox()
        for f in FORMATS:
            self.format.addItem(FORMAT_NAMES[f], f)
        self.detected = QLabel("")
        self.detected.setObjectName("hint")
        self.detected.setWordWrap(True)
        # two lines ("detected: chat (ShareGPT), chat template: ..."); a squeezed form clips it
        self.detected.setMinimumHeight(2 * self.detected.fontMetrics().lineSpacing())
        self.seq_len = QSpinBox(minimum=16, maximum=1 << 20, singleStep=128, value=d.max_seq_len)
        self.seq_len.setSuffix(" tokens")
        self.train_on = QComboBox()
        self.train_on.addItem("assistant replies only", "assistant")
        self.train_on.addItem("the last reply only", "last")
        self.train_on.addItem("every token", "all")
        self.template = QComboBox()
        self.template.setToolTip("The chat template conversations are rendered with: the "
                                 "model's own, the built-in ChatML (renders tools and tool "
                                 "calls), or a .jinja file")
        self.template.addItem("the model's own", "")
        self.template.addItem("built-in ChatML (with tools)", "chatml")
        self.template.addItem("from a file…", TEMPLATE_FILE)
        self.packing = QCheckBox("pack records together")
        self.packing.setToolTip("Several records per sequence (no attention across them); "
                                "off: one record per sequence, padded")
        self.truncation = QComboBox()
        for value, text in (("truncate", "cut to the sequence length"), ("drop", "leave out"),
                            ("error", "stop with an error")):
            self.truncation.addItem(text, value)
        self.val_mode = QComboBox()
        for value, text in zip(VALIDATION_MODES, ("none", "hold out a share", "separate file")):
            self.val_mode.addItem(text, value)
        self.val_fraction = QDoubleSpinBox(minimum=0.5, maximum=50.0, singleStep=1.0, value=5.0,
                                           decimals=1)
        self.val_fraction.setSuffix(" % of records")
        self.val_file = QPushButton("Choose validation file…")
        self.val_file.clicked.connect(self.choose_validation_file)
        self._val_path = ""

        self.form = form = QFormLayout()
        form.addRow("Format", self.format)
        form.addRow("", self.detected)
        form.addRow("Sequence length", self.seq_len)
        form.addRow("Loss on", self.train_on)
        form.addRow("Chat template", self.template)
        form.addRow("Packing", self.packing)
        form.addRow("Longer records", self.truncation)
        form.addRow("Validation", self.val_mode)
        form.addRow("", self.val_fraction)
        form.addRow("", self.val_file)
        self.settings_box = QGroupBox("Settings")
        self.settings_box.setLayout(form)
        for combo in (self.format, self.train_on, self.template, self.truncation,
                      self.val_mode):
            narrow(combo)
            combo.currentIndexChanged.connect(self._settings_edited)
        self.seq_len.valueChanged.connect(self._settings_edited)
        self.val_fraction.valueChanged.connect(self._settings_edited)
        self.packing.toggled.connect(self._settings_edited)

    def _build_summary(self) -> None:
        """As many (name, value) rows as the longest kind of summary has (SUMMARY_ROWS)."""
        self._rows: list[tuple[QLabel, QLabel]] = []
        grid = QGridLayout()
        for row in range(max(len(names) for names in SUMMARY_ROWS.values())):
            label = QLabel()
            value = QLabel()
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            value.setWordWrap(True)
            grid.addWidget(label, row, 0, Qt.AlignmentFlag.AlignTop)
            grid.addWidget(value, row, 1)
            self._rows.append((label, value))
        grid.setColumnStretch(1, 1)
        grid.setRowStretch(len(self._rows), 1)
        self.summary_box = QGroupBox("Summary")
        self.summary_box.setLayout(grid)
        self.fields: dict[str, QLabel] = {}
        """The value label of each row shown, by its name."""
        self._show_summary(dict.fromkeys(SUMMARY_ROWS["sft"], "—"))

    def _show_summary(self, rows: dict[str, str]) -> None:
        """Show ``rows`` (name: value) in the Summary; the rows left over are hidden."""
        items = list(rows.items())
        self.fields = {}
        for k, (label, value) in enumerate(self._rows):
            label.setVisible(k < len(items))
            value.setVisible(k < len(items))
            if k < len(items):
                label.setText(items[k][0])
                value.setText(items[k][1])
                self.fields[items[k][0]] = value

    def config(self) -> DataConfig:
        """The [data] section the widgets describe."""
        mode = self.val_mode.currentData()
        return replace(self.ctx.data_config,
                       format=self.format.currentData(), max_seq_len=self.seq_len.value(),
                       train_on="all" if self.train_on.currentData() == "all" else "assistant",
                       mask_history=self.train_on.currentData() == "last",
                       chat_template=self._template_choice(), packing=self.packing.isChecked(),
                       truncation=self.truncation.currentData(),
                       val_fraction=self.val_fraction.value() / 100 if mode == "fraction" else 0.0,
                       validation=self._val_path if mode == "file" else "")

    def _show_config(self, cfg: DataConfig) -> None:
        widgets = (self.format, self.seq_len, self.train_on, self.template, self.packing,
                   self.truncation,
                   self.val_mode, self.val_fraction)
        for w in widgets:
            w.blockSignals(True)
        self.format.setCurrentIndex(self.format.findData(cfg.format))
        self.seq_len.setValue(cfg.max_seq_len)
        loss = "last" if cfg.mask_history and cfg.train_on == "assistant" else cfg.train_on
        self.train_on.setCurrentIndex(self.train_on.findData(loss))
        self._show_template(cfg.chat_template)
        self.packing.setChecked(cfg.packing)
        self.truncation.setCurrentIndex(self.truncation.findData(cfg.truncation))
        self._val_path = cfg.validation or self._val_path
        mode = "file" if cfg.validation else "fraction" if cfg.val_fraction else "none"
        self.val_mode.setCurrentIndex(self.val_mode.findData(mode))
        if cfg.val_fraction:
            self.val_fraction.setValue(cfg.val_fraction * 100)
        for w in widgets:
            w.blockSignals(False)
        self._show_rows()
        self.val_file.setText(Path(self._val_path).name if self._val_path else
                              "Choose validation file…")
        self.file_label.setText(short_path(cfg.train) if cfg.train else "")

    def _show_rows(self) -> None:
        """The settings that apply: all of them to SFT data, the sequence length and the chat
        template to pairs and prompts; the validation share or file as the mode asks."""
        sft, mode = self.kind == "sft", self.val_mode.currentData()
        for w in (self.format, self.train_on, self.packing, self.truncation, self.val_mode):
            self.form.setRowVisible(w, sft)
        self.form.setRowVisible(self.val_fraction, sft and mode == "fraction")
        self.form.setRowVisible(self.val_file, sft and mode == "file")

    def _template_choice(self) -> str:
        """data.chat_template from the combo ("" / "chatml" / a path; a file is asked for)."""
        choice = self.template.currentData()
        if choice != TEMPLATE_FILE:
            return choice
        path, _ = QFileDialog.getOpenFileName(self, "Choose a chat template",
                                              str(Path.home()), "Jinja templates (*.jinja);;"
                                              "All files (*)")
        return path or self.ctx.data_config.chat_template

    def _show_template(self, choice: str) -> None:
        """Select ``choice`` in the template combo, adding a file as its own entry."""
        k = self.template.findData(choice)
        if k < 0:
            self.template.insertItem(2, Path(choice).name, choice)
            self.template.setItemData(2, choice, Qt.ItemDataRole.ToolTipRole)
            k = 2
        self.template.setCurrentIndex(k)

    @Slot()
    def _settings_edited(self) -> None:
        cfg = self.config()
        self._show_config(cfg)
        self.ctx.set_data_config(cfg)
        self.schedule()

    @Slot()
    def _on_context_changed(self) -> None:
        """Another page (Train: sequence length, presets) changed the data settings."""
        if self.ctx.data_config != self.config() or self.report is None:
            self._show_config(self.ctx.data_config)
            self.schedule()

    # ---- choosing files ----------------------------------------------------------------------
    @Slot()
    def choose_file(self) -> None:
        start = self.ctx.data_config.train or str(Path.home())
        path, _ = QFileDialog.getOpenFileName(self, "Choose a dataset", start, FILE_FILTER)
        if path:
            self.set_file(path)

    @Slot()
    def choose_validation_file(self) -> None:
        start = self._val_path or self.ctx.data_config.train or str(Path.home())
        path, _ = QFileDialog.getOpenFileName(self, "Choose a validation file", start,
                                              FILE_FILTER)
        if path:
            self._val_path = path
            self._settings_edited()

    def set_file(self, path: str) -> None:
        """Use ``path`` as the training data and prepare it."""
        path = str(Path(path).expanduser().absolute())
        self.ctx.set_data_config(replace(self.config(), train=path))
        self._show_config(self.ctx.data_config)
        self.analyse()

    @Slot()
    def use_demo(self) -> None:
        self.demo_button.setEnabled(False)
        target = self.ctx.data_dir / "datasets" / "reverse-letters.jsonl"
        run_task(make_demo_dataset, target, name="demo-data", owner=self,
                 done=lambda path: (self.demo_button.setEnabled(True), self.set_file(path)),
                 failed=lambda msg: (self.demo_button.setEnabled(True),
                                     self._show_status("error", msg)))

    def dragEnterEvent(self, event) -> None:
        if dropped_file(event.mimeData().urls()) is not None:
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        path = dropped_file(event.mimeData().urls())
        if path is not None:
            event.acceptProposedAction()
            self.set_file(path)

    # ---- preparing ---------------------------------------------------------------------------
    def schedule(self) -> None:
        """Prepare the data again shortly (several quick edits make one preparation)."""
        self._debounce.start()

    @Slot()
    def analyse(self) -> None:
        """Prepare the current settings on a worker thread; the page updates when done."""
        self._debounce.stop()
        cfg = self.ctx.data_config
        if not cfg.train:
            self._show_idle()
            return
        if not self.ctx.model_path:
            self._show_status("info", "Choose a model first (Model page): the data is "
                                      "templated and tokenised with its tokenizer.")
            return
        self._wanted = cfg
        self._show_status("busy", "Tokenising and laying out the data…")
        self.busy.setRange(0, 0)
        run_task(analyse, cfg, self.ctx.model_path, self.ctx.runs_dir / ".token-cache",
                 self._progress, name="data-prepare", owner=self,
                 done=lambda report: self._on_report(cfg, report),
                 failed=lambda message: self._on_error(cfg, message))

    @Slot(str, int, int)
    def _on_progress(self, task: str, done: int, total: int) -> None:
        if total:
            self.busy.setRange(0, total)
            self.busy.setValue(done)

    @Slot(object, str)
    def _on_kind(self, cfg: DataConfig, kind: str) -> None:
        """Lay the page out for SFT data, pairs or prompts (their figures come later)."""
        if cfg != self._wanted or kind == self.kind:
            return
        self.kind = kind
        self._show_rows()
        self.hist_box.setVisible(kind == "sft")
        title, legend = VIEWS[kind]
        self.preview_box.setTitle(title)
        self.legend.setText(legend)
        self.detected.setText(kind_line(kind))
        self._show_summary(dict.fromkeys(SUMMARY_ROWS[kind], "—"))
        self.preview.clear()

    @Slot(object, object)
    def _on_preview(self, cfg: DataConfig, shown: Preview | PairsReport | PromptsReport) -> None:
        if cfg != self._wanted:
            return
        if isinstance(shown, (PairsReport, PromptsReport)):
            self.preview.setHtml(pairs_html(shown.found) if isinstance(shown, PairsReport) else
                                 prompts_html(shown.found))
            return
        detected = "detected" if cfg.format == "auto" else "set"
        self.detected.setText(f"{detected}: {FORMAT_NAMES[shown.format]}")
        self.preview.setHtml(sample_html(shown))
        if shown.warnings and self.status.property("state") == "busy":
            self._show_status("busy", "Tokenising and laying out the data…\n" +
                              "\n".join(shown.warnings))

    def _on_report(self, cfg: DataConfig,
                   report: DataReport | PairsReport | PromptsReport) -> None:
        if cfg != self._wanted:
            return
        self.report = report
        if isinstance(report, PairsReport):
            self._show_pairs(report)
        elif isinstance(report, PromptsReport):
            self._show_prompts(report)
        else:
            self._show_sft(report)
        self.analysed.emit(report)

    def _show_sft(self, report: DataReport) -> None:
        self._on_preview(report.cfg, report.preview)
        s = report.stats
        template = f", chat template: {s.template}" if s.template else ""
        detected = "detected" if report.cfg.format == "auto" else "set"
        names = " + ".join(FORMAT_NAMES[f] for f in s.format.split(" + "))
        self.detected.setText(f"{detected}: {names}{template}")
        self._show_summary(sft_summary(s))
        self.histogram.show_stats(s)
        cached = " (from the token cache)" if s.from_cache else ""
        text = f"Ready: {s.records:,} records, {s.tokens:,} tokens{cached}."
        if report.warnings:
            text += "\n" + "\n".join(report.warnings)
        self._show_status("info" if report.warnings else "ok", text)

    def _show_pairs(self, report: PairsReport) -> None:
        found, seq_len = report.found, report.cfg.max_seq_len
        kto = found.desirable is not None
        self.detected.setText(kind_line("kto" if kto else "pairs",
                                        "; chat messages, templated" if found.template
                                        else "; plain strings, not templated"))
        self._show_summary(pairs_summary(found, seq_len))
        self.preview.setHtml(pairs_html(found))
        what = "labelled replies" if kto else "preference pairs"
        cut = (f"\n{found.truncated:,} {what} have a reply longer than the sequence length "
               f"({seq_len:,} tokens), cut at the limit." if found.truncated else "")
        read = "train.objective kto reads" if kto else "train.objective dpo, orpo and simpo read"
        self._show_status("info" if cut else "ok",
                          f"Ready: {found.pairs:,} {what}, read as {read} them.{cut}")

    def _show_prompts(self, report: PromptsReport) -> None:
        found = report.found
        self._show_summary(prompts_summary(found, report.cfg.max_seq_len))
        self.preview.setHtml(prompts_html(found))
        missing = found.prompts - found.with_answer
        note = (f"\n{missing:,} of the prompts have no answer: the answer check needs one for "
                "every prompt, or the run needs a reward file (grpo.reward in its TOML)."
                if missing else "")
        self._show_status("info" if missing else "ok", f"Ready: {found.prompts:,} prompts, read "
                          f"as train.objective grpo reads them.{note}")

    def _on_error(self, cfg: DataConfig, message: str) -> None:
        if cfg != self._wanted:
            return
        self.report = None
        self._clear_figures()
        self._show_status("error", home_relative(message))

    def _clear_figures(self) -> None:
        """No figures for settings that failed: the last good file's would mislead."""
        self.detected.setText(kind_line(self.kind))
        for value in self.fields.values():
            value.setText("—")
        self.histogram.clear_stats()
        self.preview.clear()

    def _show_idle(self) -> None:
        self._show_status("info", "No dataset chosen yet. Choose a file, drop one here, or use "
                                  "the demo dataset (a letter-reversal chat task).")

    def _show_status(self, state: str, text: str) -> None:
        self.status.setText(text)
        set_state(self.status, state)
        self.busy.setVisible(state == "busy")

    def set_colors(self, background: str, foreground: str) -> None:
        self.histogram.set_colors(background, foreground)
