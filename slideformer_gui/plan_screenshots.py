"""Render the Plan page offscreen to PNG files, for the documentation.

    python -m slideformer_gui.plan_screenshots --out docs/screenshots

The model is Llama-3.1-8B's published config.json (tests/fixtures/configs; the planner reads
nothing else), planned for a *simulated* desktop with a 24 GiB GPU and 128 GiB of RAM (its GPU's
name says so) at the reference machine's speeds, as on any machine without a measured profile.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from engine.api import REFERENCE, BudgetConfig, GpuMemory, HostMemory, resolve_budgets
from slideformer_gui.main_window import MainWindow
from slideformer_gui.plan_inputs import Machine
from slideformer_gui.screenshots import out_parser, print_paths, save, studio_window, wait_until

GiB = 1 << 30
CONFIG = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"
WINDOW_SIZE = (1360, 1080)
"""Tall enough for the whole page with the Monitor closed."""
RUN = {"budget.vram": "24GiB", "budget.ram": "128GiB", "data.max_seq_len": 2048,
       "train.micro_batch": 1, "train.grad_accum": 2}


def simulated_desktop() -> Machine:
    """A desktop with a 24 GiB GPU and 128 GiB of RAM, at the reference machine's speeds."""
    gpu = GpuMemory("Simulated GPU", 24 * GiB, int(23.4 * GiB), 0)
    host = HostMemory(128 * GiB, int(121 * GiB), int(0.4 * GiB))
    auto = resolve_budgets(BudgetConfig(), "cuda", REFERENCE, gpu, host)
    return Machine(gpu, host, REFERENCE, "cuda", auto)


def render(out: Path, config: Path = CONFIG) -> list[Path]:
    """Write the Plan page's PNGs into ``out``; returns their paths."""
    with studio_window(out) as (window, tmp):
        model = tmp / "models" / "Llama-3.1-8B"
        model.mkdir(parents=True)
        shutil.copy(config, model / "config.json")
        return _shoot(window, model, out)


def _shoot(window: MainWindow, model: Path, out: Path) -> list[Path]:
    window.resize(*WINDOW_SIZE)
    window.monitor_dock.hide()
    window.show()
    window.show_page("Plan")
    page = window.pages["Plan"]
    wait_until(lambda: page.machine is not None)
    page.set_machine(simulated_desktop())
    written = [save(window, out / "plan-no-model.png")]
    window.ctx.set_model(str(model), {})

    def planned(settings: dict) -> None:
        page.inputs.apply(settings)
        wait_until(page.settled)

    planned(RUN)
    written.append(save(window, out / "plan-tight.png"))
    planned({"train.micro_batch": 16, "budget.checkpoints": "gpu"})
    written.append(save(window, out / "plan-does-not-fit.png"))
    planned({"train.micro_batch": 1, "budget.checkpoints": "auto"})
    page.apply_fix(next(f for f in page.plan.fixes if f.fits and f.available))
    wait_until(page.settled)
    written.append(save(window, out / "plan-fits.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="a model's config.json to plan (default: Llama-3.1-8B's)")
    args = parser.parse_args(argv)
    return print_paths(render(args.out, args.config))


if __name__ == "__main__":
    sys.exit(main())
