"""Take the Model page's picture of the models found on a machine (a synthetic one: a hub cache,
Ollama and LM Studio laid out as those tools write them, weights as sparse files).

    xvfb-run -s "-screen 0 1366x768x24" python -m tools.screenshots.discovery --out docs/screenshots
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slideformer.gui.capture import (WINDOW_SIZE, out_parser, print_paths, save, studio_window,
                                     use_x_server, wait_until)
from tools.synthetic_stores import (CONFIGS, gguf_header_file, hub_entry, ollama_entry,
                                    weights_bytes)

HUB = {"meta-llama/Llama-3.2-1B-Instruct": "Llama-3.2-1B-Instruct",
       "HuggingFaceTB/SmolLM2-1.7B-Instruct": "SmolLM2-1.7B-Instruct",
       "Qwen/Qwen2.5-0.5B-Instruct": "Qwen2.5-0.5B-Instruct",
       "mistralai/Mistral-7B-Instruct-v0.3": "Mistral-7B-Instruct-v0.3"}
MAMBA = {"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280}


def fill_machine(home: Path) -> None:
    """The stores of a user who has tried a few tools, at their default places under ``home``."""
    hub = home / ".cache" / "huggingface" / "hub"
    for repo, name in HUB.items():
        cfg = CONFIGS[name]
        hub_entry(hub, repo, {"config.json": json.dumps(cfg).encode(),
                              "model.safetensors": weights_bytes(cfg)})
    hub_entry(hub, "Qwen/Qwen3-30B-A3B", {"config.json": json.dumps(CONFIGS["Qwen3-30B-A3B"]).encode()})
    hub_entry(hub, "state-spaces/mamba-130m-hf", {"config.json": json.dumps(MAMBA).encode(),
                                                  "model.safetensors": 129_135_000 * 4})
    ollama = home / ".ollama" / "models"
    for tag, name in (("llama3.2:3b", "Llama-3.2-3B-Instruct"), ("qwen2.5:7b", "Qwen2.5-7B-Instruct")):
        ollama_entry(ollama, tag, gguf_header_file(home / "tmp.gguf", CONFIGS[name], "q4_0", name))
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "Qwen3-4B-GGUF"
    gguf_header_file(lms / "Qwen3-4B-Q8_0.gguf", CONFIGS["Qwen3-4B"], "q8_0", "Qwen3-4B")


def render(out: Path) -> list[Path]:
    with studio_window(out) as (window, tmp):
        fill_machine(tmp)
        window.resize(*WINDOW_SIZE)
        window.show()
        box = window.model_page.found
        wait_until(lambda: box.scans >= 1 and not box._scanning, 120000)
        names = [box.found.found(r).name for r in range(box.found.rowCount())]
        box.table.selectRow(names.index("Qwen/Qwen2.5-0.5B-Instruct"))
        wait_until(lambda: window.monitor.history.count >= 20, 30000)  # charts with a history
        return [save(window, out / "model-discovery.png")]


def main(argv: list[str] | None = None) -> int:
    args = out_parser(__doc__).parse_args(argv)
    use_x_server()
    return print_paths(render(args.out))


if __name__ == "__main__":
    sys.exit(main())
