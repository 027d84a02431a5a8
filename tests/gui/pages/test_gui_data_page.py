"""The Data page shows the engine's own figures for a dataset, and its errors word for word."""
import json
from dataclasses import replace

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from slideformer.engine.config import DataConfig
from slideformer.engine.data import prepare_data, preview
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.gui.pages.data import DataPage


@pytest.fixture
def page(qtbot, ctx, tiny_llama):
    ctx.set_model(str(tiny_llama), {})
    p = DataPage(ctx)
    qtbot.addWidget(p)
    p.show()
    return p


def alpaca_file(path, n=60):
    with open(path, "w") as f:
        for i in range(n):
            long = " ".join(["word"] * (5 + 30 * (i % 3)))
            f.write(json.dumps({"instruction": f"say {i}", "input": "", "output": long}) + "\n")
    return path


def analysed(qtbot, page, action):
    with qtbot.waitSignal(page.analysed, timeout=30000) as got:
        action()
    return got.args[0]


def test_figures_and_preview_are_the_engines(qtbot, page, ctx, tiny_llama, tmp_path):
    path = alpaca_file(tmp_path / "alpaca.jsonl")
    page.seq_len.setValue(32)
    report = analysed(qtbot, page, lambda: page.set_file(str(path)))
    cfg = DataConfig(train=str(path), max_seq_len=32)
    assert ctx.data_config == cfg
    tok = load_tokenizer(tiny_llama)
    stats = prepare_data(cfg, tok, tmp_path / "cache").stats
    assert replace(report.stats, from_cache=stats.from_cache) == stats
    assert report.preview == preview(cfg, tok, 4)
    assert page.detected.text().startswith("detected: Alpaca")
    assert page.fields["Truncated"].text().startswith(f"{stats.truncated:,} records")
    assert stats.truncated > 0
    x0, heights = page.histogram.bars.opts["x0"], page.histogram.bars.opts["height"]
    assert list(heights) == list(stats.hist_counts) and list(x0) == list(stats.hist_edges[:-1])
    assert page.histogram.limit.value() == 32  # the line marks where truncation starts
    html = page.preview.toHtml()
    assert "say 0" in html and "#dcfce7" in html  # trained text is marked


def test_a_forced_format_that_does_not_fit_shows_the_engines_message(qtbot, page, tmp_path):
    path = alpaca_file(tmp_path / "alpaca.jsonl")
    analysed(qtbot, page, lambda: page.set_file(str(path)))
    page.format.setCurrentIndex(page.format.findData("messages"))
    qtbot.waitUntil(lambda: page.status.property("state") == "error", timeout=30000)
    assert "messages" in page.status.text() and "fix" in page.status.text()


def test_validation_share_and_dropped_file(qtbot, page, ctx, tmp_path):
    path = alpaca_file(tmp_path / "drop.jsonl")
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    drop = QDropEvent(QPointF(5, 5), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    analysed(qtbot, page, lambda: page.dropEvent(drop))
    assert ctx.data_config.train == str(path)
    page.val_mode.setCurrentIndex(page.val_mode.findData("fraction"))
    report = analysed(qtbot, page, lambda: page.val_fraction.setValue(10.0))
    assert ctx.data_config.val_fraction == pytest.approx(0.10)
    assert report.stats.val_records == 6 and page.fields["Validation"].text() == "6 records"


def test_first_records_show_before_tokenising_and_tool_calls_are_marked(qtbot, page, tmp_path):
    from tools.screenshots.data import tool_records
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in tool_records(8)))
    page.template.setCurrentIndex(page.template.findData("chatml"))
    order = []
    page._progress.previewed.connect(lambda cfg, shown: order.append(("preview", shown)))
    page.analysed.connect(lambda report: order.append(("report", report)))
    analysed(qtbot, page, lambda: page.set_file(str(path)))
    assert [k for k, _ in order] == ["preview", "report"]
    shown = order[0][1]
    assert shown == order[1][1].preview and page.ctx.data_config.chat_template == "chatml"
    trained = [p for p, t in shown.samples[0].pieces if t]
    assert trained[0].startswith('<tool_call>{"name": "get_weather"')
    assert "tokens," in page.preview.toHtml() and "dropped" in page.preview.toHtml()


def test_refused_preference_file_shows_the_message_and_no_stale_figures(qtbot, page, tmp_path):
    from tools.screenshots.data import preference_records
    good = alpaca_file(tmp_path / "alpaca.jsonl")
    analysed(qtbot, page, lambda: page.set_file(str(good)))
    path = tmp_path / "dpo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in preference_records()))
    page.set_file(str(path))
    qtbot.waitUntil(lambda: page.status.property("state") == "error", timeout=30000)
    assert "dpo.jsonl:1" in page.status.text() and "preference data" in page.status.text()
    assert page.fields["Records"].text() == "—" and "say 0" not in page.preview.toPlainText()


def test_histogram_reads_at_any_sequence_length_and_in_the_dark_theme(qtbot, page, ctx, tmp_path):
    from slideformer.gui.theme import PLOT_COLORS
    path = alpaca_file(tmp_path / "alpaca.jsonl")
    page.seq_len.setValue(32)
    analysed(qtbot, page, lambda: page.set_file(str(path)))
    hist = page.histogram
    x_min, x_max = hist.getPlotItem().viewRange()[0]
    assert hist.limit.isVisible() and x_min <= 32 <= x_max
    last_edge = hist.bars.opts["x1"][-1]

    report = analysed(qtbot, page, lambda: page.seq_len.setValue(8192))  # far beyond every record
    assert report.stats.seq_len == 8192 and report.stats.hist_edges[-1] == last_edge
    assert not hist.limit.isVisible()
    assert hist.getPlotItem().viewRange()[0][1] < 2 * last_edge  # the bars span the chart
    assert "sequence length 8192" in hist.getPlotItem().getAxis("bottom").labelText

    ctx.theme_changed.emit("dark")  # what the main window sends when the theme changes
    background, foreground = PLOT_COLORS["dark"]
    assert hist.bars.opts["pen"].color().name() == background  # no white frames on dark
    axis = hist.getPlotItem().getAxis("bottom")
    assert axis.textPen().color().name() == foreground and axis.labelStyle["color"] == foreground
