"""The Data page shows the engine's own figures for a dataset, and its errors word for word."""
import json
import re
import threading
from dataclasses import replace

import pytest
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from slideformer.engine.config import DataConfig
from slideformer.engine.data import prepare_data, preview
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.preference import describe_pairs
from slideformer.engine.models.tokenizer import load_tokenizer
from slideformer.engine.train.grpo import read_prompts
from slideformer.gui.pages.data import DataPage
from slideformer.gui.pages.data_report import SAMPLES, PairsReport, PromptsReport


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


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def plain_pairs(n=6):
    """Plain-string pairs (TRL's standard format, not templated)."""
    return [{"prompt": f"Name a prime above {10 * i}.",
             "chosen": f"{p}: no number but 1 and {p} itself divides it.",
             "rejected": f"{p + 1}"} for i, p in enumerate((11, 23, 31, 41, 53, 61, 71, 83)[:n])]


def test_preference_pairs_show_their_counts_and_marked_responses(qtbot, page, tiny_llama,
                                                                 tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", plain_pairs())
    report = analysed(qtbot, page, lambda: page.set_file(str(path)))
    assert isinstance(report, PairsReport)
    # what `data inspect --pairs` prints
    assert report.found == describe_pairs(DataConfig(train=str(path)), load_tokenizer(tiny_llama),
                                          SAMPLES)
    assert page.fields["Pairs"].text() == "6"
    assert page.fields["Prompt"].text() == f"{report.found.prompt_tokens:.1f} tokens on average"
    assert page.fields["Truncated"].text() == "0 pairs with a reply cut at 1,024 tokens"
    assert "Records" not in page.fields and page.status.property("state") == "ok"
    assert "preference pairs" in page.detected.text() and "plain strings" in page.detected.text()
    assert page.format.isHidden() and page.packing.isHidden()  # SFT's settings
    assert page.seq_len.isVisible() and page.template.isVisible() and page.hist_box.isHidden()
    html = page.preview.toHtml()
    assert "Name a prime above 0." in html and "pair 1 (pairs.jsonl:1): the chosen reply" in html
    # the response (reply + EOS) on green, the prompt not: as the CLI's [[...]] marks them
    green = re.findall(r'<span style="[^"]*#dcfce7;[^"]*">([^<]*)</span>', html)
    assert green[:2] == ["11: no number but 1 and 11 itself divides it.&lt;|im_end|&gt;",
                         "12&lt;|im_end|&gt;"]

    report = analysed(qtbot, page, lambda: page.seq_len.setValue(24))  # the long replies cut
    assert report.found.truncated == 6 and page.status.property("state") == "info"
    assert page.fields["Truncated"].text() == "6 pairs with a reply cut at 24 tokens"


def test_sft_data_after_pairs_gets_its_own_settings_and_figures_back(qtbot, page, tmp_path):
    analysed(qtbot, page, lambda: page.set_file(str(write_jsonl(tmp_path / "p.jsonl",
                                                                 plain_pairs()))))
    report = analysed(qtbot, page, lambda: page.set_file(str(alpaca_file(tmp_path / "a.jsonl"))))
    assert report.stats.records == 60 and page.fields["Records"].text().startswith("60 read")
    assert page.format.isVisible() and page.hist_box.isVisible()
    assert "Pairs" not in page.fields and page.detected.text().startswith("detected: Alpaca")


def test_grpo_prompts_show_their_count_and_templated_samples(qtbot, page, tiny_llama, tmp_path):
    from tools.screenshots.data import prompt_records
    records = prompt_records(9)
    records[7] = {"prompt": "A plain prompt: 2 + 2 ="}  # no answer: a reward file scores it
    path = write_jsonl(tmp_path / "prompts.jsonl", records)
    report = analysed(qtbot, page, lambda: page.set_file(str(path)))
    assert isinstance(report, PromptsReport)
    tok = load_tokenizer(tiny_llama)  # what `data inspect --prompts` prints: GRPO's reader
    cfg = DataConfig(train=str(path))
    prompts = read_prompts(cfg, tok, ChatRenderer(tok, cfg.chat_template, cfg.enable_thinking))
    lengths = [len(p.ids) for p in prompts]
    found = report.found
    assert (found.prompts, found.with_answer, found.max_tokens) == (9, 8, max(lengths))
    assert found.mean_tokens == pytest.approx(sum(lengths) / 9)
    assert found.samples == prompts[:SAMPLES]
    assert page.fields["Prompts"].text() == "9"
    assert page.fields["With answers"].text() == "8 (for the answer check)"
    assert page.fields["Prompt"].text().endswith(f"{report.found.max_tokens} the longest")
    assert page.status.property("state") == "info" and "1 of the prompts have no answer" in \
        page.status.text()
    text = page.preview.toPlainText()
    first = report.found.samples[0]
    assert first.text.startswith("<|begin_of_text|>")  # as the model reads it: templated
    assert "<|im_start|>user⏎" in text and "What is 3 + 9?" in text
    assert f"prompt 1 (prompts.jsonl:1): {len(first.ids)} tokens" in text
    assert "answer: 12" in text and "#dbeafe" in page.preview.toHtml()


def test_a_bad_pair_shows_its_message_and_no_stale_figures(qtbot, page, tmp_path):
    analysed(qtbot, page, lambda: page.set_file(str(write_jsonl(tmp_path / "good.jsonl",
                                                                 plain_pairs()))))
    records = plain_pairs()
    records[2]["rejected"] = records[2]["chosen"]
    page.set_file(str(write_jsonl(tmp_path / "bad.jsonl", records)))
    qtbot.waitUntil(lambda: page.status.property("state") == "error", timeout=30000)
    assert page.status.text() == (f"{tmp_path / 'bad.jsonl'}:3: has the same text as 'chosen' "
                                  "and 'rejected'\n  fix: remove the record: a pair must prefer "
                                  "one reply to another")
    assert page.fields["Pairs"].text() == "—" and page.preview.toPlainText() == ""
    assert page.report is None


def test_kto_replies_show_their_labels_and_responses(qtbot, page, tiny_llama, tmp_path):
    """KTO's labelled replies: counts as train.objective kto reads them (each record's own
    reply and label), the responses marked as a pair's are."""
    from slideformer.engine.data.preference import read_pairs
    records = [{"prompt": f"Name a prime above {i}.", "completion": c, "label": ok}
               for i, (c, ok) in enumerate([("7", True), ("8", False), ("11", True)])]
    path = write_jsonl(tmp_path / "kto.jsonl", records)
    report = analysed(qtbot, page, lambda: page.set_file(str(path)))
    assert isinstance(report, PairsReport) and report.found.desirable == 2
    tok = load_tokenizer(tiny_llama)
    found = read_pairs(DataConfig(train=str(path)), tok, kto=True).pairs
    assert [p.desirable for p in found] == [True, False, True]
    assert report.found.rejected_tokens == int(found[1].chosen.mask.sum())  # the undesirable one
    assert page.fields["Replies"].text() == "3: 2 desirable, 1 undesirable"
    text = page.preview.toPlainText()
    assert "reply 1 (kto.jsonl:1): desirable" in text and "reply 2 (kto.jsonl:2): undesirable" in text
    assert "labelled replies (prompt, completion, label) for KTO" in page.detected.text()
    assert page.status.property("state") == "ok" and "3 labelled replies" in page.status.text()


def test_pairs_are_read_off_the_gui_thread_and_the_first_show_at_once(qtbot, page, tmp_path,
                                                                     monkeypatch):
    from slideformer.gui.pages import data_report
    release, threads, real = threading.Event(), [], data_report.describe_pairs

    def held(cfg, model_path, samples):
        threads.append(threading.current_thread())
        if cfg.max_samples == 0:  # the whole file (the preview reads SAMPLES records)
            assert release.wait(30)
        return real(cfg, model_path, samples)

    monkeypatch.setattr(data_report, "describe_pairs", held)
    path = write_jsonl(tmp_path / "pairs.jsonl", plain_pairs(8))
    page.set_file(str(path))  # returns while the worker is held
    assert page.status.property("state") == "busy" and page.report is None
    qtbot.waitUntil(lambda: "pair 4" in page.preview.toPlainText(), timeout=30000)
    assert "pair 5" not in page.preview.toPlainText() and page.report is None
    assert page.fields["Pairs"].text() == "—"  # the counts wait for the whole file
    with qtbot.waitSignal(page.analysed, timeout=30000):
        release.set()
    assert page.fields["Pairs"].text() == "8"
    assert threads and threading.main_thread() not in threads


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
