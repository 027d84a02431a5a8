"""The user's path against the harness, one invocation: ``slideformer train`` on a packed JSONL
file beside ``sliding_step.py --plan`` on the same shape, tokens per step and clipping.

    python3 benchmarks/cli_path.py --shape llama-3.2-3b --micro-batch 8 --accum 1 --steps 8
    python3 benchmarks/cli_path.py --tiny      # CPU dry run on the tiny shape

The CLI run trains a random-init model folder (bf16 safetensors written tensor by tensor, a
word tokenizer whose words are the ids) on documents of random words of 64 to 2,048 tokens,
packed into rows of --seq (``data.packing``, the default: FlexAttention keeps documents apart),
with ``budget.vram`` = --vram-cap and the engine's own plan, as a user runs it. Its per-step
figures are the run's ``events.jsonl`` (``tokens_per_s``: the step's tokens over its wall time,
data included); the run is killed after its last step's event, before its checkpoint and
export (which time nothing here). ``TORCH_LOGS=recompiles`` is set on it, and the recompile lines of its log
are counted. The harness (``sliding_step.py --plan``, random rows of exactly --seq tokens, no
document masks, VRAM capped in-process at --vram-cap) runs next, in a process of its own.
Printed: both runs' step times, the medians after --warmup steps, their ratio, the CLI's peak
VRAM and RSS, the recompiles, and each run's busy seconds per lane (compute, h2d, d2h, CPU
optimizer) in one late step, from its timeline, and each run's executor shape (the CLI's from
its log).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from benchmarks.shapes import shape_config  # noqa: E402
from slideformer.engine.runtime.shapes import ExecShape  # noqa: E402
from lora_bench import word_tokenizer, write_random_folder  # noqa: E402


def write_data(path: Path, vocab: int, tokens: int, seed: int = 0) -> int:
    """JSONL of {"text"} documents of random words ("t17" ...), 64-2,048 tokens each, at least
    ``tokens`` in all; returns the number of documents."""
    rng, n, docs = random.Random(seed), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while n < tokens:
            k = rng.randint(64, 2048)
            f.write(json.dumps({"text": " ".join(f"t{rng.randrange(vocab - 1)}"
                                                 for _ in range(k))}) + "\n")
            n, docs = n + k, docs + 1
    return docs


def step_events(events: Path) -> list[dict]:
    """The run's step events so far (events.jsonl lines with tokens_per_s), skipped ones left
    out."""
    if not events.exists():
        return []
    out = []
    for line in events.read_text(encoding="utf-8").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "tokens_per_s" in ev and not ev.get("skipped"):  # a skipped step keeps its number
            out.append(ev)
    return out


LANES = ("compute", "h2d", "d2h", "optimizer")


def lane_busy(spans) -> dict:
    """Seconds of work per lane of one step's timeline spans (dicts with lane, start, end)."""
    return {lane: round(sum(sp["end"] - sp["start"] for sp in spans if sp["lane"] == lane), 4)
            for lane in LANES}


def last_timeline(events: Path) -> dict:
    """The per-lane busy seconds of the last step timeline in events.jsonl (the trainer emits a
    step's timeline after the next step), and that step's number; {} without one."""
    if not events.exists():
        return {}
    last = None
    for line in events.read_text(encoding="utf-8").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "spans" in ev:
            last = ev
    return {} if last is None else {"step": last["step"], **lane_busy(last["spans"])}


def run_cli(a, work: Path) -> dict:
    import transformers
    cfg = transformers.LlamaConfig(**shape_config(a.shape))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = work / "model"
    model.mkdir()
    t0 = time.perf_counter()
    write_random_folder(cfg, str(model), dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    word_tokenizer(cfg.vocab_size).save_pretrained(str(model))
    tokens = a.micro_batch * a.seq * a.accum
    docs = write_data(work / "train.jsonl", cfg.vocab_size, int(tokens * (a.steps + 1) * 1.2))
    prep = time.perf_counter() - t0
    (work / "run.toml").write_text(f"""[model]
path = "{model}"
[data]
train = "{work / 'train.jsonl'}"
format = "text"
max_seq_len = {a.seq}
packing = {str(not a.unpacked).lower()}
train_on = "all"
[optim]
lr = 1e-5
max_grad_norm = 1.0
[train]
micro_batch = {a.micro_batch}
grad_accum = {a.accum}
max_steps = {a.steps}
[budget]
vram = "{a.vram_cap:g}GiB"
[output]
run_dir = "{work / 'run'}"
""", encoding="utf-8")
    env = dict(os.environ, TORCH_LOGS="recompiles", PYTHONPATH=f"{ROOT}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}")
    t0 = time.perf_counter()
    events, logf = work / "run" / "events.jsonl", work / "cli.log"
    with open(logf, "w", encoding="utf-8") as out:
        p = subprocess.Popen([sys.executable, "-m", "slideformer.cli", "train", "--config",
                              str(work / "run.toml")], stdout=out, stderr=subprocess.STDOUT,
                             env=env, cwd=work)
        while p.poll() is None:  # the last step's event: stop it (no checkpoint or export)
            time.sleep(0.5)
            if len(step_events(events)) >= a.steps:
                p.kill()
                p.wait()
    wall = time.perf_counter() - t0
    log = logf.read_text(encoding="utf-8")
    if a.log:
        Path(a.log).write_text(log, encoding="utf-8")
    steps = step_events(events)
    rec = {"run": "cli", "exit": p.returncode, "wall_s": round(wall, 1), "prep_s": round(prep, 1),
           "documents": docs, "recompile_lines": sum("Recompiling" in ln or "recompil" in ln.lower()
                                                     for ln in log.splitlines()),
           "timeline": last_timeline(events),
           "executor": next((ln.split("executor: ", 1)[1] for ln in log.splitlines()
                             if "executor: " in ln), None),
           "steps": [{k: ev.get(k) for k in ("step", "tokens", "tokens_per_s", "step_time", "grad_norm",
                                             "data_time", "peak_vram", "peak_ram")}
                     for ev in steps]}
    if len(steps) < a.steps:
        rec["log_tail"] = log.strip().splitlines()[-15:]
    return rec


def run_harness(a) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sliding_step.py"), "--shape", a.shape,
           "--micro-batch", str(a.micro_batch), "--grad-accum", str(a.accum), "--seq", str(a.seq),
           "--plan", "--clip", "1.0", "--vram-cap", str(a.vram_cap), "--warmup", str(a.warmup),
           "--steps", str(a.steps - a.warmup)]
    if not torch.cuda.is_available():
        cmd += ["--device", "cpu"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    rows = [r for r in rows if "tokens_per_s" in r]
    if not rows:
        return {"run": "harness", "exit": p.returncode, "log_tail": (p.stdout + p.stderr)
                .strip().splitlines()[-15:]}
    r = rows[-1]
    return {"run": "harness", "step_times_s": r["step_times_s"], "tokens_per_s": r["tokens_per_s"],
            "peak_vram_reserved_gib": r["peak_vram_reserved_gib"], "peak_rss_gib": r["peak_rss_gib"],
            "slots": r["slots"], "gpu_checkpoints": r["gpu_checkpoints"],
            "grad_norms": r["grad_norms"], "clipped_steps": r["clipped_steps"],
            "timeline": r["busy_last_step_s"],
            "executor": ExecShape(r["micro_batch"], r["seq"], r["grad_accum"], r["slots"],
                                  r["checkpoints"], r["gpu_checkpoints"],
                                  device_update=r["device_update"],
                                  device_layers=r["device_layers"], spec_layers=r["spec_layers"],
                                  regen_layers=r["regen_layers"]).describe(
                "GPU" if torch.cuda.is_available() else "CPU")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    ap.add_argument("--vram-cap", type=float, default=24.0)
    ap.add_argument("--log", help="keep the CLI run's log here")
    ap.add_argument("--unpacked", action="store_true",
                    help="data.packing = false: a document per row, padded (no document masks)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on the tiny shape")
    a = ap.parse_args()
    if a.tiny:
        a.shape, a.micro_batch, a.accum, a.seq, a.steps, a.warmup = "tiny", 2, 2, 64, 4, 1
    scratch = "/dev/shm" if os.path.isdir("/dev/shm") and os.statvfs("/dev/shm").f_bavail * \
        os.statvfs("/dev/shm").f_frsize > 20 * (1 << 30) else None
    with tempfile.TemporaryDirectory(dir=scratch) as d:
        cli = run_cli(a, Path(d))
    print(json.dumps(cli), flush=True)
    harness = run_harness(a)
    print(json.dumps(harness), flush=True)
    tokens = a.micro_batch * a.seq * a.accum
    cli_times = [s["step_time"] for s in cli["steps"] if s.get("step_time")]
    cli_tps = [s["tokens_per_s"] for s in cli["steps"] if s.get("tokens_per_s")]
    h_times = harness.get("step_times_s", [])
    print(f"| run | tokens/step | step times s | tok/s, median after {a.warmup} |")
    print("|---|---|---|---|")
    med = {}
    rows = "unpacked" if a.unpacked else "packed"
    for name, times, tps in ((f"slideformer train ({rows} JSONL)", cli_times, cli_tps),
                             ("sliding_step.py --plan", h_times, [tokens / t for t in h_times])):
        if len(times) > a.warmup:  # the CLI's tokens/s counts the step's packed tokens
            med[name] = statistics.median(tps[a.warmup:])
            print(f"| {name} | {tokens:,} | {', '.join(f'{t:.2f}' for t in times)} | "
                  f"{med[name]:,.0f} |")
        else:
            print(f"| {name} | {tokens:,} | no timed steps | |")
    for name, run in (("CLI", cli), ("harness", harness)):
        print(f"{name} executor: {run.get('executor')}")
    for name, tl in (("CLI", cli.get("timeline")), ("harness", harness.get("timeline"))):
        if tl:  # a late step's work per lane: where a slower step's extra time sits
            print(f"{name} lanes busy s (one late step): " +
                  ", ".join(f"{lane} {tl.get(lane, 0):.3f}" for lane in LANES))
    clipped = sum((s.get("grad_norm") or 0) > 1.0 for s in cli["steps"][a.warmup:])
    print(f"steps that clipped (norm > 1.0) after {a.warmup}: CLI {clipped} of "
          f"{len(cli['steps'][a.warmup:])}, harness {harness.get('clipped_steps')} of "
          f"{len(h_times[a.warmup:])} (a clipped step updates its speculative layers after the barrier)")
    data = [s["data_time"] for s in cli["steps"][a.warmup:] if s.get("data_time") is not None]
    if data:  # the part of the CLI's step spent assembling its micro-batches
        print(f"CLI data time per step (median after {a.warmup}): {statistics.median(data):.4f} s")
    if len(med) == 2:
        c, h = med.values()
        print(f"CLI / harness: {c / h:.3f}x; CLI peaks: VRAM "
              f"{max((s['peak_vram'] or 0) for s in cli['steps']) / 2**30:.2f} GiB, RSS "
              f"{max((s['peak_ram'] or 0) for s in cli['steps']) / 2**30:.2f} GiB; recompile "
              f"lines in the CLI log: {cli['recompile_lines']}")


if __name__ == "__main__":
    main()
