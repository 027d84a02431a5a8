"""The Chat page against a stand-in engine process (tests/gui/fake_chat_engine.py) that replays
scripted replies over the real JSON-lines protocol: no model runs here."""
import json
import sys
from pathlib import Path

import pytest

from slideformer.gui.models.chat import model_choices
from slideformer.gui.pages.chat.page import ChatPage
from slideformer.gui.pages.chat.transcript import Turn, messages_for_engine, render_html
from slideformer.gui.models.runs import summarize

FAKE = str(Path(__file__).parents[1] / "fake_chat_engine.py")
WAIT = 15000


def make_run(runs_dir: Path, name: str, steps=(2, 4), final=True) -> Path:
    """A run folder as the trainer leaves it (events, checkpoints, final model)."""
    run = runs_dir / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "events.jsonl").write_text("")
    for s in steps:
        step = run / "checkpoints" / f"step-{s}"
        step.mkdir()
        (step / "manifest.json").write_text(json.dumps({"format": 1, "step": s, "files": {}}))
        (step / "trainer.json").write_text("{}")
    if final:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    return run


@pytest.fixture
def chat(qtbot, ctx, tmp_path):
    """``chat(*flags)``: a shown Chat page whose engine is the stand-in, run with ``flags``;
    the requests it receives are logged to ``page.log``."""
    pages = []

    def build(*flags, model="base-model"):
        log = tmp_path / f"requests-{len(pages)}.jsonl"
        page = ChatPage(ctx, argv_for=lambda path: [sys.executable, FAKE, path, "--log",
                                                    str(log), *flags])
        page.log = log
        qtbot.addWidget(page)
        ctx.set_model(str(tmp_path / model), {})
        page.show()
        pages.append(page)
        return page

    yield build
    for page in pages:
        page.confirm_close()


def requests(page) -> list[dict]:
    if not page.log.is_file():
        return []
    return [json.loads(line) for line in page.log.read_text().splitlines()]


def wait_ready(qtbot, pane):
    qtbot.waitUntil(lambda: pane.proc is not None and pane.proc.info is not None, timeout=WAIT)


def test_a_message_streams_a_reply_with_the_chosen_settings(qtbot, chat):
    page = chat()
    pane = page.panes[0]
    wait_ready(qtbot, pane)
    assert pane.status.property("state") == "ok" and "resident on cpu" in pane.status.text()
    page.temperature.setValue(0.0)
    page.top_p.setValue(0.5)
    page.max_tokens.setValue(32)
    page.input.setPlainText("hello there")
    page.send()
    assert not page.send_button.isEnabled() and page.stop_button.isEnabled()
    qtbot.waitUntil(lambda: not pane.busy, timeout=WAIT)
    reply = pane.turns[-1]
    assert reply.role == "assistant" and reply.text == "base-model says: hello there w0 w1 w2"
    assert reply.note == "5 tokens · 12.5 tok/s" and not reply.error
    req = requests(page)[-1]
    assert req["op"] == "generate"
    assert req["settings"] == {"temperature": 0.0, "top_p": 0.5, "max_new_tokens": 32, "seed": 0}
    assert req["messages"] == [{"role": "user", "content": "hello there"}]
    page._repaint()
    assert "base-model says: hello there" in pane.view.toPlainText()
    assert page.send_button.isEnabled() and not page.stop_button.isEnabled()
    assert page.input.toPlainText() == ""


def test_the_next_message_carries_the_conversation(qtbot, chat):
    page = chat()
    pane = page.panes[0]
    qtbot.waitUntil(lambda: pane.proc is not None, timeout=WAIT)
    for text in ("first", "second"):
        page.input.setPlainText(text)
        page.send()  # the first one waits in the pane until the model is ready
        qtbot.waitUntil(lambda: not pane.busy, timeout=WAIT)
    assert requests(page)[-1]["messages"] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "base-model says: first w0 w1 w2"},
        {"role": "user", "content": "second"}]
    page.clear()
    assert pane.turns == []


def test_stop_ends_the_reply_where_it_is(qtbot, chat):
    page = chat("--delay", "0.2", "--words", "100")
    pane = page.panes[0]
    wait_ready(qtbot, pane)
    page.input.setPlainText("go on")
    page.send()
    qtbot.waitUntil(lambda: "go on" in pane.turns[-1].text, timeout=WAIT)
    page.stop()
    qtbot.waitUntil(lambda: not pane.busy, timeout=WAIT)
    reply = pane.turns[-1]
    assert "stopped" in reply.note and len(reply.text.split()) < 50
    assert {"op": "stop", "id": 1} in requests(page)


def test_side_by_side_sends_the_same_message_to_base_and_tuned(qtbot, chat, ctx):
    run = make_run(ctx.runs_dir, "run-1")
    page = chat()
    page.mode.setCurrentIndex(page.mode.findData("side"))
    left, right = page.panes
    assert right.isVisible()
    qtbot.waitUntil(lambda: right.model_path == str(run / "final"), timeout=WAIT)
    labels = [right.models.itemText(i) for i in range(right.models.count())]
    assert labels == ["base-model (chosen model)", "run-1 · final", "run-1 · step-4",
                      "run-1 · step-2"]
    wait_ready(qtbot, left)
    wait_ready(qtbot, right)
    page.input.setPlainText("who are you?")
    page.send()
    qtbot.waitUntil(lambda: not left.busy and not right.busy, timeout=WAIT)
    assert left.turns[-1].text == "base-model says: who are you? w0 w1 w2"
    assert right.turns[-1].text == "final says: who are you? w0 w1 w2"


def test_a_model_that_cannot_load_says_why(qtbot, chat):
    page = chat("--fail", "model.safetensors is truncated")
    pane = page.panes[0]
    qtbot.waitUntil(lambda: pane.status.property("state") == "error", timeout=WAIT)
    assert pane.status.text() == "model.safetensors is truncated"
    assert not pane.busy and page.send_button.isEnabled()


def test_an_engine_crash_mid_reply_is_shown_and_the_next_message_restarts_it(qtbot, chat):
    page = chat("--crash-after", "2")
    pane = page.panes[0]
    wait_ready(qtbot, pane)
    page.input.setPlainText("one")
    page.send()
    qtbot.waitUntil(lambda: not pane.busy, timeout=WAIT)
    assert pane.turns[-1].error and "exited with code 9" in pane.turns[-1].note
    assert pane.status.property("state") == "error"
    page.input.setPlainText("two")
    page.send()  # a fresh process; it crashes after two tokens again
    qtbot.waitUntil(lambda: not pane.busy, timeout=WAIT)
    assert pane.turns[-1].text.startswith("base-model says:")
    assert requests(page)[-1]["messages"] == [{"role": "user", "content": "one"},
                                              {"role": "user", "content": "two"}]


def test_streamed_mode_is_named_with_its_speed(qtbot, chat):
    page = chat("--mode", "streamed")
    pane = page.panes[0]
    wait_ready(qtbot, pane)
    assert "streamed through the layer window" in pane.status.text() and "slow" in pane.status.text()
    page.input.setPlainText("hi")
    page.send()
    qtbot.waitUntil(lambda: not pane.busy, timeout=WAIT)
    assert "12.5 tok/s" in pane.status.text() and "streamed" in pane.turns[-1].note


def test_the_chat_page_is_in_the_sidebar(window):
    assert isinstance(window.pages["Chat"], ChatPage)


def test_model_choices_list_the_chosen_model_and_each_runs_results(tmp_path):
    run = make_run(tmp_path, "run-a", steps=(10, 20))
    bare = make_run(tmp_path, "run-b", steps=(), final=False)
    choices = model_choices("/models/base", [summarize(run), summarize(bare)], ["/x/other"])
    assert [(c.label, c.kind) for c in choices] == [
        ("base (chosen model)", "model"), ("run-a · final", "final"),
        ("run-a · step-20", "checkpoint"), ("run-a · step-10", "checkpoint"), ("other", "model")]
    assert choices[2].path == str(run / "checkpoints" / "step-20")


def test_transcript_escapes_model_output_and_leaves_notices_out_of_the_prompt():
    turns = [Turn("user", "<b>hi</b>"), Turn("notice", "Now talking to x."),
             Turn("assistant", "a & b"), Turn("assistant", "broken", error=True),
             Turn("assistant", "half", live=True)]
    html = render_html(turns)
    assert "&lt;b&gt;hi&lt;/b&gt;" in html and "a &amp; b" in html
    assert messages_for_engine(turns) == [{"role": "user", "content": "<b>hi</b>"},
                                          {"role": "assistant", "content": "a & b"}]
