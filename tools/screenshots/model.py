"""Take the Model page's and the About box's pictures for the documentation.

    xvfb-run -s "-screen 0 1366x768x24" python -m tools.screenshots.model --out docs/screenshots
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slideformer.gui.capture import (WINDOW_SIZE, out_parser, print_paths, save, studio_window,
                                     use_x_server, wait_until)
from slideformer.gui.pages.model import ensure_demo_model


QWEN3_30B_A3B = {  # the published config.json's architecture values
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1,
    "mlp_only_layers": [], "output_router_logits": False}


def render(out: Path) -> list[Path]:
    """Write one PNG per page and state into ``out``; returns their paths."""
    with studio_window(out) as (window, tmp):
        return _shoot(window, tmp, out)


def _shoot(window, tmp: Path, out: Path) -> list[Path]:
    """Take the screenshots of one main window, state by state."""
    written = []
    window.resize(*WINDOW_SIZE)
    window.show()
    page = window.model_page

    # A broken folder, with the host-only Monitor a machine without NVIDIA GPU shows.
    broken = tmp / "Downloads" / "Some-Model-7B"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    page.load(str(broken))
    wait_until(lambda: page.status.property("state") == "error")
    wait_until(lambda: window.monitor.history.count >= 2)
    written.append(save(window, out / "model-error-no-gpu.png"))

    # The demo model chosen, in both themes.
    page.load(ensure_demo_model(window.ctx.demo_model_dir))
    wait_until(lambda: page.status.property("state") == "ok")
    # what fits for each method: the planner process answers once it has started
    wait_until(lambda: bool(page.fit.fits) and page.fit._asked is None, 180000)
    wait_until(lambda: window.monitor.history.count >= 20, 30000)  # charts with a history
    written.append(save(window, out / "model-light.png"))
    window.set_theme("dark")
    written.append(save(window, out / "model-dark.png"))
    window.set_theme("light")

    # A mixture of experts known by its config.json alone (planning before the download).
    moe = tmp / "Downloads" / "Qwen3-30B-A3B"
    moe.mkdir(parents=True)
    (moe / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    page.load(str(moe))
    wait_until(lambda: page.status.property("state") == "info")
    wait_until(lambda: bool(page.fit.fits) and page.fit._asked is None, 180000)
    written.append(save(window, out / "model-moe.png"))

    about = window.show_about()
    wait_until(lambda: about.values["CUDA"].text() != "…")
    written.append(save(about, out / "about.png"))
    about.close()
    return written


def main(argv: list[str] | None = None) -> int:
    args = out_parser(__doc__).parse_args(argv)
    use_x_server()
    return print_paths(render(args.out))


if __name__ == "__main__":
    sys.exit(main())
