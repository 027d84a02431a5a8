"""Photograph the Chat page talking to real models, for the documentation.

    DISPLAY=:1 QT_QPA_PLATFORM=xcb python -m tools.screenshots.chat \\
        --base BASE_MODEL_DIR --run RUN_DIR --out docs/screenshots

Writes chat.png (the base model answering) and chat-side-by-side.png (the same question to the
base model and the run's final model). The replies are real: each model runs in its own
``slideformer chat`` process, greedy (temperature 0) so the pictures can be taken again. With a
display the whole screen is captured (ImageMagick's ``import``), else the window offscreen.
Throw-away settings and data folders; the models appear under ``~/models`` and the run under
the app's runs folder (links), so the pictures show no path of the machine they were taken on.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from slideformer.gui.main_window import MainWindow
from slideformer.gui.capture import out_parser, print_paths, run_loop, save, studio_window, \
    wait_until

WINDOW_SIZE = (1366, 768)
SINGLE = "What is the capital of France, and what is it famous for?"
COMPARE = "What is your name, and who made you?"
REPLY_S = 600


def capture(window, path: Path) -> Path:
    """The screen when there is one (what a user sees), else the window."""
    if os.environ.get("QT_QPA_PLATFORM") != "offscreen" and shutil.which("import"):
        run_loop(400)
        subprocess.run(["import", "-window", "root", str(path)], check=True)
        return path
    return save(window, path)


def render(out: Path, base: Path, run: Path) -> list[Path]:
    with studio_window(out) as (window, tmp):
        models = tmp / "models"
        models.mkdir()
        (models / base.name).symlink_to(base.resolve())
        window.ctx.runs_dir.mkdir(parents=True)
        (window.ctx.runs_dir / run.name).symlink_to(run.resolve())
        try:
            return _shoot(window, out, models / base.name)
        finally:
            window.pages["Chat"].confirm_close()


def _ask(page, text: str) -> None:
    page.input.setPlainText(text)
    page.send()
    wait_until(lambda: not any(p.busy for p in page.shown_panes()), REPLY_S * 1000)


def _shoot(window: MainWindow, out: Path, base: Path) -> list[Path]:
    window.monitor_dock.collapse_action.setChecked(True)  # a strip: the conversation needs the width
    window.resize(*WINDOW_SIZE)
    window.move(0, 0)
    window.show()
    window.model_page.load(str(base))
    wait_until(lambda: window.ctx.model_path is not None, 60000)
    page = window.pages["Chat"]
    window.show_page("Chat")
    left, right = page.panes
    wait_until(lambda: left.proc is not None and left.proc.info is not None, 300000)
    page.temperature.setValue(0.0)
    page.max_tokens.setValue(80)
    _ask(page, SINGLE)
    written = [capture(window, out / "chat.png")]

    page.clear()
    page.mode.setCurrentIndex(page.mode.findData("side"))
    # the run as the Runs page lists it (the folder its link leads to)
    right.select(next(c.path for c in page.choices if c.kind == "final"))
    wait_until(lambda: right.proc is not None and right.proc.info is not None, 300000)
    page.max_tokens.setValue(40)
    _ask(page, COMPARE)
    written.append(capture(window, out / "chat-side-by-side.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = out_parser(__doc__)
    parser.add_argument("--base", type=Path, required=True, help="the base model folder")
    parser.add_argument("--run", type=Path, required=True,
                        help="a finished run of that model (its final/ is the tuned model)")
    a = parser.parse_args(argv)
    return print_paths(render(a.out, a.base, a.run))


if __name__ == "__main__":
    sys.exit(main())
