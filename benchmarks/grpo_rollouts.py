"""GRPO's sampling speed: a prompt's G replies decoded together (train.grpo.sample_group)
against the same replies decoded one at a time (train.grpo.sample_reply), on a random-init
model of a SHAPES entry, as a GRPO step samples: ``--method full`` from the weights resident on
the device in the compute dtype; ``lora`` / ``qlora`` through the run's own training window
(train.grpo.WindowWeights: the executor the planner shapes for a GRPO run under ``--vram-cap``,
the NF4 base dequantised on the device, resident or streamed through its slots).

    python benchmarks/grpo_rollouts.py --shape llama-3.1-8b --group 8 --new-tokens 128
    python benchmarks/grpo_rollouts.py --shape llama-3.1-8b --method qlora --vram-cap 24
    python benchmarks/grpo_rollouts.py --shape small --device cpu --prompts 4 --skip-alone

``--prompts N`` also times N prompts' groups decoded in one batch (train.grpo.sample_groups,
grpo.prompts_together = N; the prompts --prompt, --prompt - 7, ... tokens long) against the same
N groups one after another (sample_group each).

Stop tokens are ignored so every reply decodes exactly ``--new-tokens`` tokens; the prompt is
``--prompt`` random ids. Reports replies/s and generated tokens/s of each way, the ratio, peak
VRAM allocated, and whether the two ways gave the same tokens (bf16 batched matmuls may round
differently from single-row ones, so a sampled token can differ: reported, not asserted).
One JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # lora_bench

from slideformer.engine.generate.sampling import SamplingConfig  # noqa: E402
from slideformer.engine.generate.window import ResidentWeights  # noqa: E402
from slideformer.engine.runtime.backend import make_backend  # noqa: E402
from slideformer.engine.train.grpo import sample_group, sample_groups, sample_reply  # noqa: E402
from benchmarks.shapes import SHAPES, shape_spec  # noqa: E402


class RandomReader:
    """Each item's weights drawn N(0, 0.02) where they land (norm weights 1: a usable model)."""

    def read_item(self, spec, item: str, out: torch.Tensor) -> torch.Tensor:
        layout = spec.layout(int(item[5:])) if item.startswith("layer") else \
            spec.embed_layout if item == "embed" else spec.head_layout
        for name, view in layout.views(out).items():
            view.fill_(1.0) if name.endswith("norm.weight") else view.normal_(0, 0.02)
        return out

    def close(self) -> None:
        pass


def window_weights(spec, backend, dtype, args):
    """A LoRA / QLoRA GRPO run's window over a random base (lora_bench's), shaped by the plan of
    that run under the VRAM cap (the cap applied after set-up, as lora_bench does); the adapters
    as initialised (B = 0: the base's replies)."""
    from lora_bench import cap, random_frozen_state
    from slideformer.engine.config import RunConfig, override
    from slideformer.engine.models.lora import for_model, lora_spec
    from slideformer.engine.plan import plan_run
    from slideformer.engine.runtime.executor import SlidingExecutor
    from slideformer.engine.train.grpo import WindowWeights
    dev = "cuda" if backend.is_cuda else "cpu"
    cfg = override(RunConfig(), {"train.method": args.method, "train.objective": "grpo",
                                 "train.micro_batch": 2 * args.group, "grpo.group_size": args.group,
                                 "grpo.max_new_tokens": args.new_tokens,
                                 "data.max_seq_len": args.seq, "data.packing": False,
                                 "budget.vram": f"{args.vram_cap}GiB", "train.device": dev})
    plan = plan_run(cfg, spec, device=dev)
    lora = for_model(lora_spec(cfg.lora), spec)
    host = random_frozen_state(spec, backend, lora, args.method == "qlora", dev, dtype)
    cap(args.vram_cap)
    ex = SlidingExecutor(spec, backend, host, plan.exec_shape, dtype, lora=lora)
    return WindowWeights(ex), {"slots": ex.k, "layers": spec.num_layers,
                               "vram_cap_gib": args.vram_cap, "plan_verdict": plan.verdict}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--method", choices=["full", "lora", "qlora"], default="full")
    ap.add_argument("--vram-cap", type=float, default=24.0, help="GiB (lora, qlora)")
    ap.add_argument("--seq", type=int, default=1024, help="data.max_seq_len of the planned run")
    ap.add_argument("--skip-alone", action="store_true", help="time only the group decoding")
    ap.add_argument("--prompts", type=int, default=1,
                    help="also time this many prompts' groups in one batch against one by one")
    args = ap.parse_args()
    spec = shape_spec(args.shape)
    backend = make_backend(args.device)
    dtype = torch.bfloat16 if backend.is_cuda else torch.float32
    t0 = time.perf_counter()
    extra = {}
    if args.method == "full":
        weights = ResidentWeights(spec, RandomReader(), dtype, backend)
    else:
        weights, extra = window_weights(spec, backend, dtype, args)
    setup_s = time.perf_counter() - t0
    prompt = torch.randint(0, spec.vocab_size, (args.prompt,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    cfgs = [SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, seed=s)
            for s in range(args.group)]
    sync = torch.cuda.synchronize if backend.is_cuda else (lambda: None)
    dev = backend.device
    warm = [SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=2, seed=s) for s in (0, 1)]
    sample_group(spec, weights, prompt, warm, frozenset(), dev, dtype)  # warm-up: kernels, slots
    sample_reply(spec, weights, prompt, warm[0], frozenset(), dev, dtype)
    sync()
    t0 = time.perf_counter()
    together = sample_group(spec, weights, prompt, cfgs, frozenset(), dev, dtype)
    sync()
    t_group = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [] if args.skip_alone else \
        [sample_reply(spec, weights, prompt, c, frozenset(), dev, dtype) for c in cfgs]
    sync()
    t_alone = time.perf_counter() - t0 if alone else None
    tokens = args.group * args.new_tokens
    row = {"shape": args.shape, "method": args.method, **extra,
           "params": spec.num_params, "device": str(
        torch.cuda.get_device_name() if backend.is_cuda else "cpu"), "dtype": str(dtype),
        "group": args.group, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
        "setup_s": round(setup_s, 1),
        "together_s": round(t_group, 3), "alone_s": t_alone and round(t_alone, 3),
        "together_replies_per_s": round(args.group / t_group, 3),
        "alone_replies_per_s": t_alone and round(args.group / t_alone, 3),
        "together_tokens_per_s": round(tokens / t_group, 1),
        "alone_tokens_per_s": t_alone and round(tokens / t_alone, 1),
        "speedup": t_alone and round(t_alone / t_group, 2),
        "same_tokens": sum(a == b for a, b in zip(together, alone)) if alone else None,
        "peak_vram_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if backend.is_cuda else None}
    if args.prompts > 1:
        row.update(prompts_together(spec, weights, args, dev, dtype, sync))
    print(json.dumps(row), flush=True)


def prompts_together(spec, weights, args, dev, dtype, sync) -> dict:
    """``--prompts`` groups in one batch (sample_groups) against one group at a time."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, spec.vocab_size, (max(1, args.prompt - 7 * q),), generator=g)
               .tolist() for q in range(args.prompts)]
    cfgs = [[SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens,
                            seed=100 * q + s) for s in range(args.group)]
            for q in range(args.prompts)]
    sync()
    t0 = time.perf_counter()
    batched = sample_groups(spec, weights, prompts, cfgs, frozenset(), dev, dtype)
    sync()
    t_batch = time.perf_counter() - t0
    t0 = time.perf_counter()
    each = [sample_group(spec, weights, p, cs, frozenset(), dev, dtype)
            for p, cs in zip(prompts, cfgs)]
    sync()
    t_each = time.perf_counter() - t0
    n = args.prompts * args.group
    return {"prompts": args.prompts, "prompts_together_s": round(t_batch, 3),
            "groups_one_by_one_s": round(t_each, 3),
            "prompts_together_replies_per_s": round(n / t_batch, 3),
            "groups_one_by_one_replies_per_s": round(n / t_each, 3),
            "prompts_speedup": round(t_each / t_batch, 2),
            "prompts_same_tokens": sum(a == b for x, y in zip(batched, each)
                                       for a, b in zip(x, y))}


if __name__ == "__main__":
    main()
