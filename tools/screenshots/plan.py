"""Take the Plan page's pictures for the documentation.

    xvfb-run -s "-screen 0 1366x768x24" python -m tools.screenshots.plan --out docs/screenshots

The model is Llama-3.1-8B's published config.json (tests/fixtures/configs; the planner reads
nothing else: a model planned before its download), planned for the RTX 4090 preset (its vendor
figures) in a host with 128 GiB of RAM typed in, at 1366x768 in a real X window.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from slideformer.gui.main_window import MainWindow
from slideformer.gui.capture import (WINDOW_SIZE, out_parser, print_paths, save, studio_window,
                                         use_x_server, wait_until)

CONFIG = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"
TARGET = "rtx4090"
RUN = {"budget.vram": "23GiB", "budget.ram": "128GiB", "data.max_seq_len": 2048,
       "train.micro_batch": 1, "train.grad_accum": 2}


def render(out: Path, config: Path = CONFIG) -> list[Path]:
    """Write the Plan page's PNGs into ``out``; returns their paths."""
    with studio_window(out) as (window, tmp):
        model = tmp / "models" / "Llama-3.1-8B"
        model.mkdir(parents=True)
        shutil.copy(config, model / "config.json")
        return _shoot(window, model, out)


def _shoot(window: MainWindow, model: Path, out: Path) -> list[Path]:
    window.resize(*WINDOW_SIZE)
    window.show()
    window.show_page("Plan")
    page = window.pages["Plan"]
    wait_until(lambda: page.machine is not None, 60000)
    page.inputs.target.setCurrentIndex(page.inputs.target.findData(TARGET))
    wait_until(lambda: page.machine.profile.preset == TARGET, 60000)
    written = [save(window, out / "plan-no-model.png")]
    window.ctx.set_model(str(model), {})

    def settled() -> bool:  # the plan and its line of per-method verdicts
        return page.settled() and page._methods_asked is None and page.methods.isEnabled()

    def planned(settings: dict) -> None:
        page.inputs.apply(settings)
        wait_until(settled, 180000)

    planned(RUN)
    written.append(save(window, out / "plan-tight.png"))
    planned({"train.micro_batch": 16, "budget.checkpoints": "gpu"})
    written.append(save(window, out / "plan-does-not-fit.png"))
    planned({"train.micro_batch": 1, "budget.checkpoints": "auto"})
    page.apply_fix(next(f for f in page.plan.fixes if f.fits and f.available))
    wait_until(settled, 180000)
    written.append(save(window, out / "plan-fits.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="a model's config.json to plan (default: Llama-3.1-8B's)")
    args = parser.parse_args(argv)
    use_x_server()
    return print_paths(render(args.out, args.config))


if __name__ == "__main__":
    sys.exit(main())
