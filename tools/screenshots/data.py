"""Render the Data page with a tool-calling conversation, preference pairs, GRPO's prompts and a
refused pair.

    xvfb-run -s "-screen 0 1366x768x24" python -m tools.screenshots.data --out docs/screenshots

Writes data-tools.png, data-pairs.png, data-prompts.png and data-refused.png: a real X window
(xcb) filling a 1366x768 screen, the Monitor beside the page, on throw-away settings and data
folders, with the demo model.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slideformer.gui.pages.model import ensure_demo_model
from slideformer.gui.capture import (out_parser, print_paths, save, studio_window,
                                     use_x_server, wait_until)

SCREEN = (1366, 768)
TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]


def tool_records(n: int = 40) -> list[dict]:
    """ShareGPT tool-calling conversations (LLaMA-Factory's layout: tools as JSON text)."""
    cities = ["Paris", "Lima", "Oslo", "Pune", "Kyoto"]
    out = []
    for i in range(n):
        city, temp = cities[i % len(cities)], 10 + i % 17
        out.append({"conversations": [
            {"from": "human", "value": f"What is the weather in {city}?"},
            {"from": "function_call",
             "value": json.dumps({"name": "get_weather", "arguments": {"city": city}})},
            {"from": "observation", "value": json.dumps({"temp_c": temp})},
            {"from": "gpt", "value": f"It is {temp} degrees in {city}."}],
            "tools": json.dumps(TOOLS)})
    return out


CAPITALS = [("France", "Paris", "Lyon"), ("Japan", "Tokyo", "Osaka"), ("Peru", "Lima", "Cusco"),
            ("Norway", "Oslo", "Bergen"), ("Canada", "Ottawa", "Toronto")]


def pair_records(n: int = 40) -> list[dict]:
    """Conversational preference pairs as TRL writes them (one assistant message a reply)."""
    out = []
    for i in range(n):
        country, right, wrong = CAPITALS[i % len(CAPITALS)]
        out.append({"prompt": [{"role": "user", "content": f"What is the capital of {country}?"}],
                    "chosen": [{"role": "assistant", "content": f"{right} is the capital of "
                                                                f"{country}."}],
                    "rejected": [{"role": "assistant", "content": f"I think it is {wrong}."}]})
    return out


def prompt_records(n: int = 40) -> list[dict]:
    """GRPO's prompts: a sum to work out, and its answer for the answer check."""
    system = "Work it out, then give the number alone on the last line."
    return [{"prompt": [{"role": "system", "content": system},
                        {"role": "user", "content": f"What is {7 * i + 3} + {5 * i + 9}?"}],
             "answer": str(12 * i + 12)} for i in range(n)]


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def render(out: Path) -> list[Path]:
    with studio_window(out) as (window, tmp):
        window.resize(*SCREEN)
        window.move(0, 0)
        window.show()
        ctx = window.ctx
        window.model_page.load(ensure_demo_model(ctx.demo_model_dir))
        suggest = window.pages["Train"].settings.suggest_button
        # the Train page's first suggestion sets the sequence length: the pictures come after
        wait_until(lambda: ctx.model_path is not None and suggest.isEnabled(), 60000)
        page = window.pages["Data"]
        window.show_page("Data")
        page.template.setCurrentIndex(page.template.findData("chatml"))
        page.set_file(_write(tmp / "weather-tools.jsonl", tool_records()))
        wait_until(lambda: page.report is not None and page.report.cfg == ctx.data_config,
                   60000)
        _scroll_to(page.preview, "It is ")  # the call, its result and the answer in view
        written = [save(window, out / "data-tools.png")]
        page.template.setCurrentIndex(page.template.findData(""))  # the model's own
        for name, file, records in (("pairs", "dpo-pairs.jsonl", pair_records()),
                                    ("prompts", "grpo-prompts.jsonl", prompt_records())):
            page.set_file(_write(tmp / file, records))
            wait_until(lambda: page.report is not None and page.report.cfg == ctx.data_config,
                       60000)
            written.append(save(window, out / f"data-{name}.png"))
        bad = pair_records(6)
        bad[2]["rejected"] = bad[2]["chosen"]  # the same reply twice: no preference
        page.set_file(_write(tmp / "dpo-pairs-bad.jsonl", bad))
        wait_until(lambda: page.status.property("state") == "error", 60000)
        written.append(save(window, out / "data-refused.png"))
        return written


def _scroll_to(browser, text: str) -> None:
    browser.find(text)
    cursor = browser.textCursor()
    cursor.clearSelection()
    browser.setTextCursor(cursor)
    browser.ensureCursorVisible()


def main(argv: list[str] | None = None) -> int:
    args = out_parser(__doc__).parse_args(argv)
    use_x_server()
    return print_paths(render(args.out))


if __name__ == "__main__":
    sys.exit(main())
