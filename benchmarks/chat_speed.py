"""Generation speed of ``slideformer chat``: resident (KV cache) and streamed through the window.

    python benchmarks/chat_speed.py MODEL_DIR [--device cpu|cuda] [--tokens 64] [--runs 3]
                                    [--modes resident,streamed] [--slots 2]

For each mode: load time, then ``--runs`` greedy replies of exactly ``--tokens`` new tokens to
the same chat prompt (stop tokens ignored so every run decodes the same count), reporting the
prompt length, prefill seconds and decode tok/s of each run and their median. One JSON line per
mode at the end (``RESULT {...}``) for the record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from slideformer.engine.generate.sampling import SamplingConfig
from slideformer.engine.generate.session import ChatModel

PROMPT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


def bench(model_dir: str, mode: str, device: str, tokens: int, runs: int, slots: int) -> dict:
    t0 = time.perf_counter()
    model = ChatModel(model_dir, mode=mode, device=device, slots=slots)
    load_s = time.perf_counter() - t0
    model.stop_ids = frozenset()  # decode exactly `tokens` tokens every run
    prompt = model.prompt_ids(PROMPT)
    cfg = SamplingConfig(temperature=0, max_new_tokens=tokens)
    rows = []
    for _ in range(runs):
        fin = list(model.tokens(prompt, cfg))[-1]
        rows.append((fin.prefill_s, fin.tokens_per_s))
        print(f"  {mode}: prompt {fin.prompt_tokens} tokens, prefill {fin.prefill_s:.3f} s, "
              f"{fin.new_tokens} new tokens at {fin.tokens_per_s:.2f} tok/s", flush=True)
    model.close()
    return {"mode": mode, "device": device, "dtype": str(model.dtype).removeprefix("torch."),
            "slots": slots if mode == "streamed" else None, "load_s": round(load_s, 2),
            "prompt_tokens": len(prompt), "new_tokens": tokens,
            "prefill_s_median": round(statistics.median(r[0] for r in rows), 3),
            "tok_per_s_median": round(statistics.median(r[1] for r in rows), 2),
            "threads": torch.get_num_threads(), "load_avg": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="resident,streamed")
    p.add_argument("--slots", type=int, default=2)
    a = p.parse_args()
    results = [bench(a.model, m, a.device, a.tokens, a.runs, a.slots)
               for m in a.modes.split(",")]
    for r in results:
        print("RESULT " + json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
