"""The Data page: choose a dataset, see what the model will be trained on.

Every figure comes from the engine (:func:`slideformer.engine.api.analyse_data`), run on a worker thread
with the chosen model's tokenizer and chat template: the detected format, record and token
counts, truncation, the validation split, the
record-length histogram, and the first records as the model sees them, with the tokens that carry
a loss marked. The preview reads only the first records, so it shows within a fraction of a second
whatever the file's size, before the whole file is tokenised (a refused record, too, shows its
message then). Tokenising fills the same cache the run reads, so Start does not tokenise again.
The settings here are the run's ``[data]`` section (:meth:`AppContext.set_data_config`).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, replace
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QFrame, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QProgressBar,
                               QPushButton, QScrollArea, QSpinBox, QTextBrowser, QVBoxLayout,
                               QWidget)

from slideformer.engine.api import (FORMATS, DataConfig, DataStats, Log, Preview, Progress, analyse_data,
                        sample_counts, write_task)
from slideformer.gui.context import AppContext
from slideformer.gui.models.formatting import human_count, short_path
from slideformer.gui.workers.thread import run_task
from slideformer.gui.theme import PLOT_COLORS
from slideformer.gui.pages.train.settings import narrow
from slideformer.gui.widgets.common import action_row, page_header, set_state, status_label

SAMPLES = 4
DEBOUNCE_MS = 300
"""A setting changed: wait this long for the next change before preparing the data again."""
DEMO_RECORDS = 4000
LEFT_COLUMN_PX = 380
FILE_FILTER = ("Datasets (*.jsonl *.json *.txt *.csv *.parquet *.arrow *.feather);;"
               "All files (*)")
FORMAT_NAMES = {"auto": "auto-detect", "text": "plain text", "alpaca": "Alpaca (instruction / "
                "output)", "messages": "chat (OpenAI messages)", "sharegpt": "chat (ShareGPT)"}
VALIDATION_MODES = ("none", "fraction", "file")
TEMPLATE_FILE = "\0file"
"""The chat-template entry that asks for a .jinja file."""
TRAINED_COLOR, MASKED_COLOR, TRUNCATED_COLOR = "#16a34a", "#9ca3af", "#f59e0b"
AXIS_LABEL = "record length (tokens, before truncation)"
FAR_BEYOND = 4
"""A sequence length this many times the longest record's bin edge is drawn as a note on the
axis, not as a line far to the right of every bar."""


@dataclass(frozen=True)
class DataReport:
    """The engine's answer for one set of data settings."""

    cfg: DataConfig
    stats: DataStats
    preview: Preview
    """The first records as the model sees them."""
    warnings: list[str]
    """The engine's warnings (preview and preparation)."""


class _Progress(QObject):
    """Carries the engine's Progress events and the early preview from the worker thread."""

    changed = Signal(str, int, int)
    previewed = Signal(object, object)
    """(DataConfig, Preview): the first records, before the whole file is tokenised."""


def analyse(cfg: DataConfig, model_path: str, cache_dir: Path, progress: _Progress) -> DataReport:
    """Preview the first records of ``cfg`` (sent on at once), then prepare it (cached)."""
    warnings: list[str] = []

    def emit(ev) -> None:
        if isinstance(ev, Progress):
            progress.changed.emit(ev.task, ev.done, ev.total or 0)
        elif isinstance(ev, Log) and ev.level != "info":
            warnings.append(ev.message)

    found = analyse_data(cfg, model_path, cache_dir, SAMPLES, emit,
                         on_preview=lambda shown: progress.previewed.emit(cfg, shown))
    return DataReport(cfg, found.stats, found.preview, list(found.preview.warnings) + warnings)


def make_demo_dataset(path: Path) -> str:
    """The letter-reversal chat dataset of ``slideformer demo`` (kept when it exists)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_task(path, DEMO_RECORDS, seed=1)
    return str(path)


def sample_html(shown: Preview) -> str:
    """The preview as HTML: trained pieces on green, masked ones grey."""
    parts = []
    for i, sample in enumerate(shown.samples, 1):
        spans = []
        for piece, trained in sample.pieces:
            text = html.escape(piece).replace("\n", "⏎<br>")
            style = ("background-color:#dcfce7; color:#065f46;" if trained else
                     f"color:{MASKED_COLOR};")
            spans.append(f'<span style="{style}">{text}</span>')
        where = html.escape(Path(sample.where).name)
        parts.append(f'<p style="margin:0 0 2px 0; color:#6b7280; font-size:8pt;">record {i} '
                     f'({where}): {sample_counts(sample)}</p>'
                     f'<p style="font-family:monospace; margin:0 0 12px 0;">{"".join(spans)}</p>')
    return "".join(parts)


def dropped_file(urls) -> str | None:
    if len(urls) != 1 or not urls[0].isLocalFile():
        return None
    p = Path(urls[0].toLocalFile())
    return str(p) if p.exists() else None


class LengthHistogram(pg.PlotWidget):
    """Record lengths in tokens: bars from DataStats, the sequence length as a line."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.setMenuEnabled(False)
        self._background = "#ffffff"
        self.setBackground(self._background)
        item = self.getPlotItem()
        item.showGrid(y=True, alpha=0.15)
        item.setLabel("bottom", AXIS_LABEL)
        item.setLabel("left", "records")
        self.bars = pg.BarGraphItem(x0=[], x1=[], height=[], brush=TRAINED_COLOR)
        self.addItem(self.bars)
        self.limit = pg.InfiniteLine(angle=90, movable=False,
                                     pen=pg.mkPen(TRUNCATED_COLOR, width=2, style=Qt.DashLine),
                                     label="sequence length", labelOpts={
                                         "position": 0.9, "color": TRUNCATED_COLOR,
                                         "anchors": [(1, 0), (1, 0)]})
        self.addItem(self.limit)
        self.limit.hide()  # until there is data to compare it with
        self.getPlotItem().setXRange(0, DataConfig().max_seq_len, padding=0)
        self.getPlotItem().setYRange(0, 1, padding=0)

    def show_stats(self, stats: DataStats) -> None:
        edges, counts = stats.hist_edges, stats.hist_counts
        brushes = [pg.mkBrush(TRUNCATED_COLOR if lo >= stats.seq_len else "#3b82f6")
                   for lo in edges[:-1]]
        self.bars.setOpts(x0=list(edges[:-1]), x1=list(edges[1:]), height=list(counts),
                          brushes=brushes, pen=pg.mkPen(self._background, width=1))
        self.limit.setPos(stats.seq_len)
        self.limit.label.setFormat(f"sequence length {stats.seq_len}")
        # A sequence length far beyond the longest record would squeeze every bar into the
        # left edge: the axis then spans the records, and its label says that all of them fit.
        far = stats.seq_len > FAR_BEYOND * edges[-1]
        self.limit.setVisible(not far)
        self.getPlotItem().setLabel("bottom", f"{AXIS_LABEL}: all shorter than the sequence "
                                              f"length {stats.seq_len}" if far else AXIS_LABEL)
        right = (edges[-1] if far else max(edges[-1], stats.seq_len)) * 1.05
        self.getPlotItem().setXRange(0, right, padding=0)
        self.getPlotItem().setYRange(0, max(counts, default=1) * 1.1, padding=0)

    def clear_stats(self) -> None:
        self.bars.setOpts(x0=[], x1=[], height=[], brushes=[])
        self.limit.hide()
        self.getPlotItem().setLabel("bottom", AXIS_LABEL)

    def set_colors(self, background: str, foreground: str) -> None:
        self._background = background  # bar outlines: gaps between bars, not white frames
        self.setBackground(background)
        self.bars.setOpts(pen=pg.mkPen(background, width=1))
        for name in ("left", "bottom"):
            axis = self.getPlotItem().getAxis(name)
            axis.setPen(pg.mkPen(foreground))
            axis.setTextPen(pg.mkPen(foreground))
            axis.setLabel(axis.labelText, color=foreground)


class DataPage(QWidget):
    """Dataset file, its [data] settings, and what the engine makes of it."""

    analysed = Signal(object)
    """A :class:`DataReport` for the current settings arrived."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setAcceptDrops(True)
        self.report: DataReport | None = None
        self._wanted: DataConfig | None = None
        """The settings being prepared; answers for any other settings are stale."""
        self._progress = _Progress(self)
        self._progress.changed.connect(self._on_progress)
        self._progress.previewed.connect(self._on_preview)
        self._debounce = QTimer(self, singleShot=True, interval=DEBOUNCE_MS)
        self._debounce.timeout.connect(self.analyse)

        self.choose_button = QPushButton("Choose file…")
        self.choose_button.setObjectName("primary")
        self.choose_button.clicked.connect(self.choose_file)
        self.demo_button = QPushButton("Use demo dataset")
        self.demo_button.setToolTip("4,000 chat records of a letter-reversal task that the demo "
                                    "model learns in a minute, written into\n"
                                    f"{ctx.data_dir / 'datasets'}")
        self.demo_button.clicked.connect(self.use_demo)
        self.busy = QProgressBar()
        self.busy.setMaximumWidth(160)
        self.busy.setTextVisible(False)
        self.busy.hide()
        actions = action_row((self.choose_button, self.demo_button), "or drop a file here",
                             self.busy)

        self.file_label = QLabel("")
        self.file_label.setObjectName("folder")
        self.file_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status = status_label()

        self._build_settings()
        self._build_summary()
        self.histogram = LengthHistogram()
        self.histogram.setMinimumHeight(120)
        hist_box = QGroupBox("Record lengths")
        QVBoxLayout(hist_box).addWidget(self.histogram)
        self.preview = QTextBrowser()
        self.preview.setOpenLinks(False)
        legend = QLabel(f'<span style="background-color:#dcfce7; color:#065f46;">&nbsp;trained '
                        f'(has a loss)&nbsp;</span>&nbsp;&nbsp;<span style="color:{MASKED_COLOR};">'
                        f'masked (prompt, template)</span>&nbsp;&nbsp;⏎ line break')
        legend.setObjectName("hint")
        legend.setWordWrap(True)
        preview_box = QGroupBox("What the model sees: the first records, templated")
        pv = QVBoxLayout(preview_box)
        pv.addWidget(legend)
        pv.addWidget(self.preview, 1)

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
        right = QVBoxLayout()
        right.addWidget(hist_box, 2)
        right.addWidget(preview_box, 3)
        body = QHBoxLayout()
        body.addWidget(left_scroll, 0)
        body.addLayout(right, 1)
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Data", "The training data: a JSONL/JSON, CSV, Parquet or "
                                          "Arrow file (text, Alpaca, chat messages or ShareGPT, "
                                          "with tool calls) or plain text. It is "
                                          "templated and tokenised with the model's own "
                                          "tokenizer, exactly as the run will see it."))
        lay.addLayout(actions)
        lay.addWidget(self.file_label)
        lay.addWidget(self.status)
        lay.addLayout(body, 1)

        ctx.model_changed.connect(lambda _path: self.schedule())
        ctx.data_changed.connect(self._on_context_changed)
        ctx.theme_changed.connect(lambda name: self.set_colors(*PLOT_COLORS[name]))
        self.set_colors(*PLOT_COLORS[ctx.settings.theme()])
        self._show_config(ctx.data_config)
        self._show_idle()

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

        form = QFormLayout()
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
        self.fields: dict[str, QLabel] = {}
        grid = QGridLayout()
        for row, name in enumerate(("Records", "Validation", "Tokens", "Trained tokens",
                                    "Sequences", "Truncated", "Left out")):
            label = QLabel(name)
            value = QLabel("—")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            value.setWordWrap(True)
            grid.addWidget(label, row, 0, Qt.AlignmentFlag.AlignTop)
            grid.addWidget(value, row, 1)
            self.fields[name] = value
        grid.setColumnStretch(1, 1)
        grid.setRowStretch(len(self.fields), 1)
        self.summary_box = QGroupBox("Summary")
        self.summary_box.setLayout(grid)

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
        self.val_fraction.setVisible(mode == "fraction")
        self.val_file.setVisible(mode == "file")
        self.val_file.setText(Path(self._val_path).name if self._val_path else
                              "Choose validation file…")
        self.file_label.setText(short_path(cfg.train) if cfg.train else "")

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
        run_task(make_demo_dataset, target, name="demo-data",
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
                 self._progress, name="data-prepare",
                 done=lambda report: self._on_report(cfg, report),
                 failed=lambda message: self._on_error(cfg, message))

    @Slot(str, int, int)
    def _on_progress(self, task: str, done: int, total: int) -> None:
        if total:
            self.busy.setRange(0, total)
            self.busy.setValue(done)

    @Slot(object, object)
    def _on_preview(self, cfg: DataConfig, shown: Preview) -> None:
        if cfg != self._wanted:
            return
        detected = "detected" if cfg.format == "auto" else "set"
        self.detected.setText(f"{detected}: {FORMAT_NAMES[shown.format]}")
        self.preview.setHtml(sample_html(shown))
        if shown.warnings and self.status.property("state") == "busy":
            self._show_status("busy", "Tokenising and laying out the data…\n" +
                              "\n".join(shown.warnings))

    def _on_report(self, cfg: DataConfig, report: DataReport) -> None:
        if cfg != self._wanted:
            return
        self.report = report
        self._on_preview(cfg, report.preview)
        s = report.stats
        template = f", chat template: {s.template}" if s.template else ""
        detected = "detected" if cfg.format == "auto" else "set"
        names = " + ".join(FORMAT_NAMES[f] for f in s.format.split(" + "))
        self.detected.setText(f"{detected}: {names}{template}")
        self.fields["Records"].setText(f"{s.records:,} read, {s.train_records:,} for training")
        self.fields["Validation"].setText(f"{s.val_records:,} records" if s.val_records else
                                          "none")
        self.fields["Tokens"].setText(f"{s.tokens:,}  ({human_count(s.tokens)})")
        share = s.trained_tokens / max(1, s.tokens)
        self.fields["Trained tokens"].setText(f"{s.trained_tokens:,}  ({share:.0%} of tokens); "
                                              f"{s.dropped_tokens:,} dropped (in no sequence)")
        self.fields["Sequences"].setText(f"{s.train_sequences:,} × {s.seq_len} tokens, "
                                         f"{'packed' if s.packing else 'padded'}, "
                                         f"{s.fill:.0%} filled")
        cut = f"; {s.split:,} texts cut into blocks" if s.split else ""
        self.fields["Truncated"].setText(f"{s.truncated:,} records longer than {s.seq_len}{cut}")
        self.fields["Left out"].setText(f"{s.dropped:,} too long, {s.no_target:,} with nothing "
                                        f"to train")
        self.histogram.show_stats(s)
        cached = " (from the token cache)" if s.from_cache else ""
        text = f"Ready: {s.records:,} records, {s.tokens:,} tokens{cached}."
        if report.warnings:
            text += "\n" + "\n".join(report.warnings)
        self._show_status("info" if report.warnings else "ok", text)
        self.analysed.emit(report)

    def _on_error(self, cfg: DataConfig, message: str) -> None:
        if cfg != self._wanted:
            return
        self.report = None
        self._clear_figures()
        self._show_status("error", message)

    def _clear_figures(self) -> None:
        """No figures for settings that failed: the last good file's would mislead."""
        self.detected.setText("")
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
