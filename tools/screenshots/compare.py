"""Take the Runs page's comparison and the Train page's suggested settings for the documentation.

    xvfb-run -s "-screen 0 1366x768x24" python -m tools.screenshots.compare --out docs/screenshots

Three real CPU runs of the demo model on the demo task (learning rates 1e-3, 3e-3 and 1e-2,
validation every 5 steps, the last with early stopping and keep_best) are made in the app's
runs folder, then chosen together on the Runs page. The Train page is photographed after the
demo model was chosen with the settings untouched: the suggestion fills them; and showing a real
DPO run of the demo model (pairs: the demo task's answer chosen, a reversed one rejected), whose
rewards take the learning rate's chart.
"""
from __future__ import annotations

import sys
from pathlib import Path

import json

from slideformer.engine.api import config_from_dict, run_training, write_task
from slideformer.gui.capture import (WINDOW_SIZE, out_parser, print_paths, save, studio_window,
                                     use_x_server, wait_until)
from slideformer.gui.pages.model import ensure_demo_model

RUNS = (("lr-1e-3", 1e-3, {}), ("lr-3e-3", 3e-3, {}),
        ("lr-1e-2-early", 1e-2, {"train": {"early_stopping_patience": 2},
                                 "output": {"keep_best": True}}))


def render(out: Path) -> list[Path]:
    with studio_window(out) as (window, tmp):
        return _shoot(window, tmp, out)


def _runs(model: str, tmp: Path, runs_dir: Path) -> None:
    write_task(tmp / "task.jsonl", 300, 1)
    write_task(tmp / "val.jsonl", 30, 2)
    for name, lr, extra in RUNS:
        data = {"model": {"path": model},
                "data": {"train": str(tmp / "task.jsonl"), "validation": str(tmp / "val.jsonl"),
                         "max_seq_len": 64},
                "optim": {"lr": lr, "warmup_steps": 2},
                "train": {"micro_batch": 4, "max_steps": 40, "eval_every": 5, "device": "cpu",
                          **extra.get("train", {})},
                "budget": {"slots": 2},
                "output": {"run_dir": str(runs_dir / name), **extra.get("output", {})}}
        assert run_training(config_from_dict(data, name)) == "finished"


def _dpo_run(model: str, tmp: Path, runs_dir: Path) -> Path:
    pairs = tmp / "pairs.jsonl"
    with open(pairs, "w") as f:
        for line in (tmp / "task.jsonl").read_text().splitlines():
            rec = json.loads(line)
            q, a = rec["messages"][0]["content"], rec["messages"][1]["content"]
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}],
                                "chosen": [{"role": "assistant", "content": a}],
                                "rejected": [{"role": "assistant", "content": a[::-1] + "x"}]})
                    + "\n")
    run_dir = runs_dir / "dpo-demo"
    cfg = config_from_dict({
        "model": {"path": model}, "data": {"train": str(pairs), "max_seq_len": 64},
        "optim": {"lr": 3e-3, "warmup_steps": 2}, "budget": {"slots": 2},
        "train": {"objective": "dpo", "micro_batch": 4, "max_steps": 40, "device": "cpu"},
        "output": {"run_dir": str(run_dir)}}, "dpo-demo")
    assert run_training(cfg) == "finished"
    return run_dir


def _shoot(window, tmp: Path, out: Path) -> list[Path]:
    written = []
    window.resize(*WINDOW_SIZE)
    window.show()
    ctx = window.ctx
    model = ensure_demo_model(ctx.demo_model_dir)
    _runs(model, tmp, ctx.runs_dir)

    train = window.pages["Train"]
    window.show_page("Train")
    window.model_page.load(model)
    wait_until(lambda: train.settings.preset.currentText().startswith("Suggested"), 60000)
    written.append(save(window, out / "train-suggested.png"))

    runs = window.pages["Runs"]
    window.show_page("Runs")
    wait_until(lambda: runs.table.topLevelItemCount() == len(RUNS), 30000)
    runs.table.selectAll()
    wait_until(lambda: runs.compare_view.differences.topLevelItemCount() > 0, 30000)
    written.append(save(window, out / "runs-compare.png"))

    dpo = _dpo_run(model, tmp, ctx.runs_dir)
    ctx.request_run(str(dpo), False)
    wait_until(lambda: train.dashboard.corner.currentWidget() is train.dashboard.plots["rewards"],
               30000)
    train.dashboard.repaint_all()
    written.append(save(window, out / "train-dpo.png"))
    return written


def main() -> int:
    args = out_parser(__doc__).parse_args()
    use_x_server()
    return print_paths(render(args.out))


if __name__ == "__main__":
    sys.exit(main())
