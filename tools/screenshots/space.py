"""Take the Train page refusing a run whose folder's disk cannot hold its checkpoint and model.

    mkdir -p /tmp/small-disk && sudo mount -t tmpfs -o size=1m tmpfs /tmp/small-disk
    xvfb-run -s "-screen 0 1366x768x24" python -m tools.screenshots.space \\
        --disk /tmp/small-disk --out docs/screenshots

The demo model and the demo task are chosen as a user would, the run folder is set to a new
folder on ``--disk`` (a real small file system: the refusal is the engine's own check of the
free space, train/space.py), Start is pressed and the page is photographed once the engine
process has failed.
"""
from __future__ import annotations

import sys
from pathlib import Path

from slideformer.gui.capture import (WINDOW_SIZE, out_parser, print_paths, save, studio_window,
                                     use_x_server, wait_until)
from slideformer.gui.pages.model import ensure_demo_model


def render(out: Path, disk: Path) -> list[Path]:
    with studio_window(out) as (window, _tmp):
        window.resize(*WINDOW_SIZE)
        window.show()
        window.model_page.load(ensure_demo_model(window.ctx.demo_model_dir))
        window.show_page("Data")
        data = window.pages["Data"]
        data.demo_button.click()
        wait_until(lambda: data.report is not None, 30000)
        window.show_page("Train")
        page = window.pages["Train"]
        page.settings.device.setCurrentIndex(page.settings.device.findData("cpu"))
        run_dir = disk / "my-run"
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = disk / f"my-run-{n}"
        page.settings.output.setText(str(run_dir))
        page.start_button.click()
        wait_until(lambda: page.end is not None, 120000)
        return [save(window, out / "train-no-space.png")]


def main() -> int:
    ap = out_parser(__doc__)
    ap.add_argument("--disk", type=Path, required=True, help="a folder on a small file system")
    args = ap.parse_args()
    use_x_server()
    return print_paths(render(args.out, args.disk))


if __name__ == "__main__":
    sys.exit(main())
