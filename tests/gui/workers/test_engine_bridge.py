"""EngineBridge on its own: scripted stand-in engines (a few lines of Python that write events
and exit as a real engine would), so each way a run ends is checked without training."""
import sys
import textwrap

from slideformer.engine.events import RunState, to_json
from slideformer.gui.workers.run import EngineBridge

END_MS = 120_000  # a generous bound for a busy machine; not a speed assertion


def stand_in(run_dir, body: str) -> list[str]:
    """The argv of a process that runs ``body`` with ``emit(event)`` appending to events.jsonl."""
    script = textwrap.dedent(f"""\
        import sys, time
        from slideformer.engine.events import RunState, to_json
        def emit(ev):
            with open({str(run_dir / "events.jsonl")!r}, "a") as f:
                f.write(to_json(ev) + "\\n")
        """) + textwrap.dedent(body)
    return [sys.executable, "-c", script]


def run_bridge(qtbot, bridge, then=None):
    """Run ``bridge`` to its end; returns (events in order, RunEnd). ``then(bridge)`` is called
    once the first events arrived."""
    got, ends = [], []
    bridge.events.connect(got.extend)
    bridge.ended.connect(ends.append)
    bridge.start()
    if then is not None:
        qtbot.waitUntil(lambda: bool(got), timeout=END_MS)
        then(bridge)
    qtbot.waitUntil(lambda: bool(ends), timeout=END_MS)
    bridge.wait()
    return got, ends[0]


def test_a_finished_run_reports_every_event_and_its_end(qtbot, tmp_path):
    argv = stand_in(tmp_path, """\
        emit(RunState("setup"))
        emit(RunState("running", step=1))
        emit(RunState("finished", "done after 1 step", step=1))
        """)
    got, end = run_bridge(qtbot, EngineBridge(tmp_path, argv))
    assert [ev.state for ev in got] == ["setup", "running", "finished"]
    assert (end.outcome, end.message) == ("finished", "done after 1 step")


def test_a_config_error_before_any_event_is_the_cli_message(qtbot, tmp_path):
    argv = stand_in(tmp_path, """\
        print("loading")
        print("error: model.path: /nowhere is not a folder", file=sys.stderr)
        sys.exit(2)
        """)
    got, end = run_bridge(qtbot, EngineBridge(tmp_path, argv))
    assert got == [] and end.outcome == "failed"
    assert end.message == "model.path: /nowhere is not a folder"
    assert "loading" in end.log_tail  # the engine's console output, kept in engine.log


def test_abort_kills_an_owned_engine_and_says_how_it_ended(qtbot, tmp_path):
    argv = stand_in(tmp_path, """\
        emit(RunState("running", step=1))
        time.sleep(600)
        """)
    got, end = run_bridge(qtbot, EngineBridge(tmp_path, argv), then=EngineBridge.abort)
    assert [ev.state for ev in got] == ["running"]
    assert end.outcome == "failed" and "SIGKILL" in end.message


def test_commands_for_a_followed_run_go_to_its_control_file(qtbot, tmp_path):
    """A followed run with no live engine (killed earlier) ends as interrupted; the commands
    given before that were written for it (each is carried out before the next liveness check)."""
    (tmp_path / "events.jsonl").write_text(to_json(RunState("running", step=4)) + "\n")
    bridge = EngineBridge(tmp_path)
    bridge.pause()
    bridge.stop_and_save()
    got, end = run_bridge(qtbot, bridge)
    assert got == [RunState("running", step=4, time=got[0].time)]
    assert end.outcome == "interrupted"
    assert (tmp_path / "control").read_text().splitlines() == ["pause", "stop"]
