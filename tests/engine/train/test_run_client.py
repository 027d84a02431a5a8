"""slideformer.engine.api.RunClient: real engine processes (the tiny model on the CPU) started, followed and
steered through their run folder, as the desktop app and scripts do."""
import subprocess
from pathlib import Path

import pytest

from slideformer.engine.api import (RunClient, RunState, StepMetrics, TinyShape, checkpoints, config_from_dict,
                        dumps, engine_command, engine_env, make_tiny_model, write_task)

FOLLOW_S = 300  # a generous bound for a busy 2-core machine; not a speed assertion


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    make_tiny_model(root / "model", "llama", TinyShape(layers=2, hidden=32, heads=2, kv_heads=1,
                                                       intermediate=48), seed=1)
    write_task(root / "train.jsonl", 60, 1)
    return root


def write_config(base: Path, name: str, steps: int) -> Path:
    cfg = config_from_dict({
        "model": {"path": str(base / "model")},
        "data": {"train": str(base / "train.jsonl"), "max_seq_len": 32},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "train": {"micro_batch": 2, "max_steps": steps, "device": "cpu"},
        "budget": {"slots": 2},
        "output": {"run_dir": str(base / name)}})
    path = base / f"{name}.toml"
    path.write_text(dumps(cfg), encoding="utf-8")
    return path


def test_start_and_follow_a_run_to_its_end(base):
    client = RunClient(base / "run-a")
    client.start(write_config(base, "run-a", 3))
    followed = list(client.follow(timeout=FOLLOW_S))
    assert client.process.returncode == 0, client.log_path.read_text()
    assert [ev.step for ev in followed if isinstance(ev, StepMetrics)] == [1, 2, 3]
    assert client.state() == [ev for ev in followed if isinstance(ev, RunState)][-1]
    assert client.state().state == "finished"
    assert len(client.events()) == len(followed)  # follow saw every event of the file
    assert (client.run_dir / "final" / "config.json").is_file()
    assert client.alive() is None


def test_steer_a_run_started_elsewhere(base):
    """Pause, resume and stop a terminal-started run from a client that only knows its folder."""
    run_dir = base / "run-b"
    argv = engine_command("train", "--config", str(write_config(base, "run-b", 100_000)))
    proc = subprocess.Popen(argv, env=engine_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = RunClient(run_dir)
    states, steps, resumed_at = [], [], None
    try:
        for ev in client.follow(timeout=FOLLOW_S):
            if isinstance(ev, StepMetrics):
                steps.append(ev.step)
                if len(steps) == 1:
                    client.pause()
                elif resumed_at is not None and ev.step > resumed_at and "stop" not in states:
                    client.stop(save=True)
                    states.append("stop")
            elif isinstance(ev, RunState):
                states.append(ev.state)
                if ev.state == "paused":
                    resumed_at = ev.step
                    client.resume()
    except BaseException:
        proc.kill()
        raise
    # The run has ended (stopped, control file gone); its process may still be exiting.
    assert proc.wait(timeout=FOLLOW_S) == 0, proc.stderr.read().decode()
    assert "paused" in states and states[-1] == "stopped"
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] < 100_000
    newest = checkpoints(run_dir / "checkpoints")[0]
    assert newest.name == f"step-{steps[-1]}"  # stop saved the state of its last step
    assert client.state().state == "stopped"


def test_a_failed_run_ends_the_follow_with_its_message(base, tmp_path):
    cfg = write_config(base, "run-c", 3)
    missing = tmp_path / "missing"
    cfg.write_text(cfg.read_text().replace(str(base / "model"), str(missing)))
    client = RunClient(base / "run-c")
    client.start(cfg)
    followed = list(client.follow(timeout=FOLLOW_S))
    assert client.process.returncode == 2
    assert followed[-1].state == "failed" and str(missing) in followed[-1].message
    assert client.state() == followed[-1]
    assert f"error: {missing}" in client.log_path.read_text()
