"""Side by side on one model: dense HF, ours resident, DeepSpeed ZeRO-3 offload, ours sliding.

    python3 benchmarks/side_by_side.py --shape llama-3.2-3b --seq 1024 --micro-batch 8 \\
        --grad-accum 1 4 8 --vram-cap 24 --contenders dense,resident,deepspeed,sliding \\
        --max-batch --out $OUT/side_by_side

Each contender (benchmarks/contenders.py says what each one is) runs in a child process of its
own, every grad-accum size inside it (ours sliding: a process per size, each with the host state
its plan needs, as ``slideformer train`` runs; ``--one-process``: one), while this process samples
the RSS of the child's whole process tree (sum over the tree, ~10 Hz). Writes ``<out>.json`` (every record, in full),
``<out>.md`` (the table) and ``<out>.<contender>.log`` (the child's output), rewritten after
each contender so a run cut short keeps what finished, and prints the table last.

A contender that fails (out of memory, import error, ``--timeout``) is recorded with the tail
of its output and the run goes on. ``--merge A.json B.json`` rebuilds one table from runs
made separately (e.g. one device call per contender group); the table says so.
``--dry-run-cpu`` runs the whole flow on the CPU with the tiny shape (DeepSpeed is skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import psutil

from contenders_common import CAPPED, CONTENDERS, MARK, BenchConfig
from sliding_step import SHAPES, shape_spec

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
SAMPLE_S = 0.1
TAIL = 3000
"""Characters of a failed child's output kept in the JSON."""


# ---- one child process ----------------------------------------------------------------------------
@dataclass
class ChildRun:
    """What one contender process left: its records and how it ended."""
    records: list[dict]
    peak_rss_tree: int
    wall_s: float
    returncode: int | None
    timed_out: bool
    tail: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of a process and all its descendants (shared pages counted per process)."""
    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_contender(contender: str, cfg: BenchConfig, log_path: Path, timeout: float) -> ChildRun:
    """Run one contender process to its end (or ``timeout`` seconds), sampling its tree's RSS.
    Each record gets ``peak_rss_tree_gib``: the tree's peak from the start until it arrived."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if contender == "deepspeed":  # a single-process "world" for torch.distributed
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, str(HERE / "contenders.py"), contender, cfg.to_json()],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)  # its own process group: a timeout ends it all
    proc = psutil.Process(child.pid)
    peak = [0]
    records: list[dict] = []
    tail: list[str] = []

    def read() -> None:
        with open(log_path, "w", encoding="utf-8") as log:
            for line in child.stdout:
                log.write(line)
                log.flush()
                tail.append(line)
                del tail[:-200]
                if line.startswith(MARK):
                    try:
                        rec = json.loads(line[len(MARK):])
                    except json.JSONDecodeError:
                        continue
                    records.append(dict(rec, peak_rss_tree_gib=round(peak[0] / GiB, 2)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    while child.poll() is None:
        peak[0] = max(peak[0], tree_rss(proc))
        if time.perf_counter() - t0 > timeout:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)
            break
        time.sleep(SAMPLE_S)
    child.wait()
    reader.join(timeout=10)
    return ChildRun(records, peak[0], round(time.perf_counter() - t0, 1), child.returncode,
                    timed_out, "".join(tail)[-TAIL:])


def run_per_size(contender: str, cfg: BenchConfig, log_path: Path, timeout: float) -> ChildRun:
    """One process per grad-accum size, each with the host state the planner's shape for that
    size needs, as ``slideformer train`` builds it (each size's peak RSS is its own, not the
    highest of the sizes before it), then one for the largest micro-batch search."""
    parts = [(str(a), replace(cfg, grad_accum=(a,), max_batch=False)) for a in cfg.grad_accum]
    if cfg.max_batch:
        parts.append(("max_batch", replace(cfg, grad_accum=())))
    runs, logs = [], []
    for tag, one in parts:
        logs.append(log_path.with_suffix(f".{tag}.log"))
        runs.append(run_contender(contender, one, logs[-1], timeout))
    log_path.write_text("".join(p.read_text(encoding="utf-8") for p in logs if p.is_file()),
                        encoding="utf-8")
    for p in logs:
        p.unlink(missing_ok=True)
    done = all(any(r.get("kind") == "done" for r in run.records) for run in runs)
    records = [r for run in runs for r in run.records if r.get("kind") not in ("done", "info")]
    info = [r for r in runs[0].records if r.get("kind") == "info"][:1]
    bad = next((r for r in runs if r.returncode), runs[-1])
    return ChildRun(info + records + ([{"kind": "done"}] if done else []),
                    max(r.peak_rss_tree for r in runs), round(sum(r.wall_s for r in runs), 1),
                    bad.returncode, any(r.timed_out for r in runs), bad.tail)


def collect(contender: str, cfg: BenchConfig, run: ChildRun, log_path: Path) -> dict:
    """One contender's entry of the JSON: a row per grad-accum size (failed ones too)."""
    by_kind: dict[str, list[dict]] = {}
    for rec in run.records:
        rec = dict(rec)
        by_kind.setdefault(rec.pop("kind"), []).append(rec)
    skipped = by_kind.get("skipped")
    done = bool(by_kind.get("done"))
    why = None if done else ("killed at the --timeout" if run.timed_out else
                             f"exited with code {run.returncode} before finishing")
    rows = []
    for accum in cfg.grad_accum:
        ok = [r for r in by_kind.get("result", []) if r["grad_accum"] == accum]
        bad = [r for r in by_kind.get("error", []) if r["grad_accum"] == accum]
        if ok:
            rows.append(dict(ok[0], status="ok"))
        elif bad:
            rows.append(dict(bad[0], status="oom" if bad[0].get("oom") else "failed"))
        elif not skipped:
            rows.append(dict(grad_accum=accum, status="failed", error=why or "no result"))
    status = ("skipped" if skipped else "ok" if done and all(r["status"] == "ok" for r in rows)
              else "failed" if not any(r["status"] == "ok" for r in rows) else "partial")
    info = by_kind.get("info", [{}])[0]
    return dict(status=status, capped=contender in CAPPED, info=info, rows=rows,
                max_batch=by_kind.get("max_batch", []),
                skipped=skipped[0]["reason"] if skipped else None,
                peak_rss_tree_gib=round(run.peak_rss_tree / GiB, 2), wall_s=run.wall_s,
                returncode=run.returncode, timed_out=run.timed_out, error=why,
                tail=None if status == "ok" else run.tail, log=str(log_path))


def add_ratios(results: dict) -> None:
    """tok/s of each row over dense's, DeepSpeed's and SlideFormer's at the same tokens/step."""
    def tps(name: str, accum: int) -> float | None:
        rows = results.get(name, {}).get("rows", [])
        return next((r["tokens_per_s"] for r in rows
                     if r["grad_accum"] == accum and r["status"] == "ok"), None)

    for entry in results.values():
        for r in entry["rows"]:
            for key, base in (("vs_dense", "dense"), ("vs_deepspeed", "deepspeed"),
                              ("vs_slideformer", "slideformer")):
                b = tps(base, r["grad_accum"])
                r[key] = round(r["tokens_per_s"] / b, 2) if r["status"] == "ok" and b else None


# ---- the table ------------------------------------------------------------------------------------
def _label(name: str, entry: dict, meta: dict) -> str:
    cfg = meta["config"]
    cap = f", cap {cfg['vram_cap']:g} GiB" if entry["capped"] and cfg["vram_cap"] else ", uncapped"
    return {"dense": f"dense HF ({cfg['dense_dtype']}){cap}",
            "resident": f"ours, every layer resident{cap}",
            "deepspeed": f"DeepSpeed ZeRO-3 offload{cap}",
            "slideformer": f"SlideFormer's public code{cap}",
            "sliding": f"ours, sliding{cap}"}[name]


def _shape(r: dict) -> str:
    """Our executor shape of a row: K slots, checkpoint placement, what the GPU updates."""
    if "slots" not in r:
        return ""
    dev = (f", GPU updates embed/head + {r.get('device_layers', 0)} layers"
           if r.get("device_update") else "")
    return f" (K = {r['slots']}, checkpoints {r.get('checkpoints')}{dev})"


def _tokens(cfg: dict, mb: int, accum: int) -> str:
    n = mb * cfg["seq"] * accum
    size = f"{n // 1024}K" if n % 1024 == 0 else str(n)
    return f"{size} ({mb}×{cfg['seq']}" + (f" ×{accum})" if accum > 1 else ")")


def _f(x, fmt: str = ",.0f") -> str:
    return "–" if x is None else format(x, fmt)


def _vram(r: dict) -> str:
    a, b = r.get("peak_vram_alloc_gib"), r.get("peak_vram_reserved_gib")
    return "–" if a is None else f"{a:.1f} / {b:.1f}"


def markdown(meta: dict, results: dict) -> str:
    cfg = meta["config"]
    envs = {n: e["info"] for n, e in results.items() if e["info"]}
    env = next(iter(envs.values()), {})
    ds = results.get("deepspeed", {}).get("info", {}).get("deepspeed")
    lines = [f"## Side by side — {cfg['shape']} shape ({meta['params']:,} params), seq {cfg['seq']}, "
             f"micro-batch {cfg['micro_batch']}",
             "",
             f"{meta['date']}; {env.get('gpu', cfg['device'])}, torch {env.get('torch')}, "
             f"transformers {env.get('transformers')}" + (f", DeepSpeed {ds}" if ds else "") +
             f"; {cfg['warmup']} warm-up + {cfg['steps']} timed steps, median; clipping "
             f"{cfg['clip'] or 'off'}; VRAM cap {cfg['vram_cap']:g} GiB on the capped contenders " +
             ("(torch.cuda.set_per_process_memory_fraction; the CUDA context is outside it)."
              if cfg["device"] == "cuda" else "(dry run on the CPU: only the planner's budget)."),
             ""]
    if len(meta.get("sources", [])) > 1:
        lines += [f"Merged from {len(meta['sources'])} separate invocations "
                  f"({', '.join(meta['sources'])}): ratios across them compare different processes "
                  "on machines of the same kind, not one invocation.", ""]
    lines += ["| contender | tokens/step | tok/s | model TFLOP/s | peak VRAM alloc / reserved (GiB) "
              "| peak RSS, process tree (GiB) | vs dense | vs DeepSpeed | vs SlideFormer "
              "| bounding resource |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for accum in cfg["grad_accum"]:
        for name, entry in results.items():
            for r in entry["rows"]:
                if r["grad_accum"] != accum:
                    continue
                tok = _tokens(cfg, cfg["micro_batch"], accum)
                if r["status"] != "ok":
                    lines.append(f"| {_label(name, entry, meta)} | {tok} | {r['status']} | – | "
                                 f"{_vram(r)} | {_f(r.get('peak_rss_tree_gib'), '.1f')} | – | – | – | "
                                 f"{str(r.get('error', ''))[:80]} |")
                    continue
                lines.append(f"| {_label(name, entry, meta)}{_shape(r)} | {tok} | {_f(r['tokens_per_s'])} | "
                             f"{_f(r['model_tflops'])} | {_vram(r)} | "
                             f"{_f(r['peak_rss_tree_gib'], '.1f')} | {_f(r['vs_dense'], '.2f')} | "
                             f"{_f(r['vs_deepspeed'], '.2f')} | {_f(r['vs_slideformer'], '.2f')} | "
                             f"{r['bounding']} |")
    lines += _max_batch_lines(meta, results) + _notes(meta, results)
    return "\n".join(lines) + "\n"


def _max_batch_lines(meta: dict, results: dict) -> list[str]:
    cfg = meta["config"]
    tries = [(n, r) for n, e in results.items() for r in e["max_batch"]]
    if not tries:
        return []
    lines = ["", f"### Largest micro-batch at seq {cfg['seq']} under the {cfg['vram_cap']:g} GiB cap "
             "(grad_accum 1)", "",
             "| contender | micro-batch | outcome | tok/s | peak VRAM alloc / reserved (GiB) | note |",
             "|---|---|---|---|---|---|"]
    for name, r in tries:
        outcome = "ran" if "tokens_per_s" in r else ("out of memory" if r.get("oom") else "failed")
        note = ""
        if "planner_max" in r:
            shape = r.get("planner_shape") or {}
            note = (f"planner's largest: {r['planner_max']}{_shape(shape)}; expected: {r.get('expected')}")
        if outcome == "failed":
            note = (note + "; " if note else "") + str(r.get("error", ""))[:100]
        lines.append(f"| {_label(name, results[name], meta)} | {r['micro_batch']} | {outcome} | "
                     f"{_f(r.get('tokens_per_s'))} | {_vram(r)} | {note} |")
    for name in ("deepspeed", "sliding"):
        ran = [r["micro_batch"] for n, r in tries if n == name and "tokens_per_s" in r]
        if name in results and results[name]["max_batch"]:
            base = cfg["micro_batch"] if name == "deepspeed" and any(
                r["status"] == "ok" and r["grad_accum"] == 1 for r in results[name]["rows"]) else 0
            lines.append(f"\nLargest that ran, {name}: {max(ran + [base]) or 'none'}.")
    return lines


def _notes(meta: dict, results: dict) -> list[str]:
    lines = []
    for name, e in results.items():
        params = e["info"].get("params")
        if params is not None and params != meta["params"]:
            lines.append(f"- {name}: its model has {params:,} parameters, not {meta['params']:,}: "
                         "TFLOP/s use the latter")
        if e["skipped"]:
            lines.append(f"- {name}: skipped — {e['skipped']}")
        elif e["error"]:  # the process did not finish: say how it ended
            last = (e.get("tail") or "").strip().splitlines()[-1:] or [""]
            lines.append(f"- {name}: {e['status']} ({e['error']}); last output: "
                         f"`{last[0][:200]}`; full log: {e['log']}")
    return ["", "Notes:"] + lines if lines else []


# ---- driver ---------------------------------------------------------------------------------------
def write_outputs(out: Path, meta: dict, results: dict) -> str:
    results = {n: results[n] for n in sorted(results, key=CONTENDERS.index)}
    add_ratios(results)
    table = markdown(meta, results)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(dict(meta=meta, contenders=results), indent=1))
    Path(f"{out}.md").write_text(table)
    return table


def make_meta(cfg: BenchConfig, out: Path) -> dict:
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(sys.argv), config=asdict(cfg),
                params=shape_spec(cfg.shape).num_params,
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), sources=[f"{out}.json"])


def merge(paths: list[str], out: Path) -> str:
    """One table from several result files of the same configuration (later files win)."""
    meta, results = None, {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        if meta is None:
            meta = dict(data["meta"], sources=[])
        elif data["meta"]["config"] != meta["config"]:
            raise SystemExit(f"side_by_side.py --merge: {p} was run with another configuration "
                             f"than {paths[0]}; merge only runs of the same one")
        meta["sources"].append(str(p))
        results.update(data["contenders"])
    return write_outputs(out, meta, results)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="llama-3.2-3b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--vram-cap", type=float, default=24.0,
                    help="GiB for deepspeed and sliding (dense and resident are uncapped); 0: none")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated, run in this order: {','.join(CONTENDERS)}")
    ap.add_argument("--slots", type=int, default=0,
                    help="K of the sliding contender, every update on the CPU; 0: the planner's shape")
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm clipping; 0: off")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--head-chunk", type=int, default=2048, help="our LM-head chunk (tokens)")
    ap.add_argument("--dense-dtype", choices=("fp32-master", "bf16"), default="fp32-master",
                    help="fp32-master: bf16 autocast over fp32 weights + AdamW (the same maths as "
                         "ours and DeepSpeed's); bf16: bf16 weights and AdamW")
    ap.add_argument("--max-batch", action="store_true",
                    help="also find the largest micro-batch under the cap (deepspeed, sliding)")
    ap.add_argument("--ds-batches", type=int, nargs="+", default=[10, 12, 14, 16],
                    help="micro-batches DeepSpeed tries in turn up to the first out-of-memory")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per contender")
    ap.add_argument("--one-process", action="store_true",
                    help="run every size of our sliding contender in one process (default: a "
                         "process per size with the host state its plan needs)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="CPU, tiny shape, no VRAM cap: the harness flow without a GPU")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine earlier result files")
    ap.add_argument("--out", required=True, help="output prefix: writes PREFIX.json and PREFIX.md")
    a = ap.parse_args()
    unknown = set(a.contenders.split(",")) - set(CONTENDERS)
    if unknown:
        ap.error(f"--contenders: unknown {sorted(unknown)}; use some of {','.join(CONTENDERS)}")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be at least 1 (the bottleneck is read from a warm step)")
    if a.max_batch and not a.vram_cap:
        ap.error("--max-batch needs a --vram-cap to search under")
    return a


def main() -> None:
    a = parse_args()
    out = Path(a.out)
    if a.merge:
        print(merge(a.merge, out))
        return
    cfg = BenchConfig(shape="tiny" if a.dry_run_cpu else a.shape, seq=a.seq,
                      micro_batch=a.micro_batch, grad_accum=tuple(a.grad_accum),
                      vram_cap=a.vram_cap, slots=a.slots, clip=a.clip, warmup=a.warmup,
                      steps=a.steps, head_chunk=a.head_chunk,
                      device="cpu" if a.dry_run_cpu else "cuda", dense_dtype=a.dense_dtype,
                      max_batch=a.max_batch, ds_batches=tuple(a.ds_batches))
    meta = make_meta(cfg, out)
    results: dict[str, dict] = {}
    table = ""
    for name in a.contenders.split(","):
        print(f"[side_by_side] {name} ...", flush=True)
        log = Path(f"{out}.{name}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        if name == "sliding" and not a.one_process:
            run = run_per_size(name, cfg, log, a.timeout)
        else:
            run = run_contender(name, cfg, log, a.timeout)
        results[name] = collect(name, cfg, run, log)
        e = results[name]
        print(f"[side_by_side] {name}: {e['status']} in {e['wall_s']} s, peak RSS (tree) "
              f"{e['peak_rss_tree_gib']} GiB", flush=True)
        table = write_outputs(out, meta, results)
    print(table)


if __name__ == "__main__":
    main()
