"""run_task: the callbacks reach their owner while it exists, and never after it is destroyed
(a page closed while its task still runs; the CI failure of a Data page callback on a deleted
label)."""
import threading

import shiboken6
from PySide6.QtWidgets import QLabel

from slideformer.gui.workers.thread import TaskError, run_task

END_MS = 60_000  # a generous bound for a busy machine; not a speed assertion


def held_task(qtbot, owner, result, fail: bool = False):
    """A task that ends once the returned event is set; its done/failed calls are recorded."""
    release, calls = threading.Event(), []

    def work():
        release.wait()
        if fail:
            raise TaskError(result)
        return result

    task = run_task(work, owner=owner, name="test-task",
                    done=lambda v: (calls.append(("done", v)), owner.setText(v)),
                    failed=lambda m: (calls.append(("failed", m)), owner.setText(m)))
    return task, release, calls


def test_a_live_owner_gets_the_result_and_the_failure(qtbot):
    label = QLabel()
    qtbot.addWidget(label)
    for fail in (False, True):
        task, release, calls = held_task(qtbot, label, "answer", fail)
        with qtbot.waitSignal(task.finished, timeout=END_MS):
            release.set()
        assert calls == [("failed" if fail else "done", "answer")]
        assert label.text() == "answer"


def test_a_destroyed_owner_is_not_called_back(qtbot):
    for fail in (False, True):
        label = QLabel()
        task, release, calls = held_task(qtbot, label, "late", fail)
        shiboken6.delete(label)  # the page is gone while its task still runs
        assert not shiboken6.isValid(label)
        with qtbot.waitSignal(task.finished, timeout=END_MS):
            release.set()
        qtbot.wait(10)  # let any queued delivery run: it would raise on the deleted label
        assert calls == []


def test_a_task_deleted_before_its_worker_ends_raises_nothing_there(qtbot, monkeypatch):
    """The application closing while a worker runs deletes the task's C++ object; the worker's
    emits then have no source. It ends quietly instead of printing a traceback at exit."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    label = QLabel()
    qtbot.addWidget(label)
    task, release, calls = held_task(qtbot, label, "answer")
    thread = task._thread
    shiboken6.delete(task)
    release.set()
    thread.join(END_MS / 1000)
    assert not thread.is_alive()
    assert errors == [] and calls == []
    from slideformer.gui.workers.thread import _live
    assert task not in _live

