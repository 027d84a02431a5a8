"""The side-by-side harness (benchmarks/side_by_side.py): rows, ratios and failures from
recorded child output, one real contender process, and the whole flow as a CPU dry run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import side_by_side as sbs  # noqa: E402
from contenders_common import MARK, BenchConfig  # noqa: E402

CFG = BenchConfig(shape="tiny", seq=32, micro_batch=2, grad_accum=(1, 4), vram_cap=24.0,
                  max_batch=True)


def _result(accum: int, tps: float, kind: str = "result", mb: int = 2) -> dict:
    return dict(kind=kind, micro_batch=mb, grad_accum=accum, seq=32, tokens_per_step=mb * 32 * accum,
                step_time_s=mb * 32 * accum / tps, tokens_per_s=tps, model_tflops=1.0,
                peak_vram_alloc_gib=1.5, peak_vram_reserved_gib=2.0, peak_rss_gib=3.0,
                bounding="GPU compute (0.50 s busy of a 0.60 s step)", peak_rss_tree_gib=3.5)


def _runs() -> dict[str, sbs.ChildRun]:
    info = dict(kind="info", gpu="Test GPU", torch="2.x", transformers="5.x")
    oom = dict(kind="error", grad_accum=4, oom=True, error="OutOfMemoryError: CUDA out of memory")
    return {
        "dense": sbs.ChildRun([info, _result(1, 100.0), _result(4, 400.0), dict(kind="done")],
                              2 << 30, 10.0, 0, False, ""),
        "deepspeed": sbs.ChildRun([dict(info, deepspeed="0.19.8"), _result(1, 50.0), oom,
                                   _result(1, 60.0, "max_batch", 10),
                                   dict(kind="max_batch", micro_batch=12, grad_accum=1, oom=True,
                                        error="OutOfMemoryError"), dict(kind="done")],
                                  70 << 30, 100.0, 0, False, ""),
        "sliding": sbs.ChildRun([info, _result(1, 100.0)], 50 << 30, 600.0, -9, True,
                                "step 3 ...\n"),
    }


def test_rows_ratios_failures_and_merge(tmp_path):
    results = {n: sbs.collect(n, CFG, r, tmp_path / f"{n}.log") for n, r in _runs().items()}
    meta = sbs.make_meta(CFG, tmp_path / "all")
    table = sbs.write_outputs(tmp_path / "all", meta, results)
    data = json.loads((tmp_path / "all.json").read_text())["contenders"]

    assert [r["status"] for r in data["dense"]["rows"]] == ["ok", "ok"]
    assert [r["status"] for r in data["deepspeed"]["rows"]] == ["ok", "oom"]
    assert data["deepspeed"]["status"] == "partial"
    sliding = data["sliding"]
    assert [r["status"] for r in sliding["rows"]] == ["ok", "failed"]
    assert sliding["timed_out"] and "--timeout" in sliding["rows"][1]["error"]
    assert sliding["tail"].startswith("step 3")
    assert sliding["rows"][0]["vs_dense"] == 1.0 and sliding["rows"][0]["vs_deepspeed"] == 2.0
    assert data["dense"]["rows"][1]["vs_deepspeed"] is None  # DeepSpeed ran out of memory there
    assert data["sliding"]["peak_rss_tree_gib"] == 50.0

    assert (tmp_path / "all.md").read_text() == table
    assert "| 256 (2×32 ×4) | oom |" in table
    assert "| 12 | out of memory |" in table and "Largest that ran, deepspeed: 10." in table
    assert "sliding: partial (killed at the --timeout" in table

    # the same contenders run in two invocations, then merged: the same rows, and the table says so
    for part, names in (("a", ["deepspeed"]), ("b", ["dense", "sliding"])):
        part_results = {n: sbs.collect(n, CFG, _runs()[n], tmp_path / f"{n}.log") for n in names}
        sbs.write_outputs(tmp_path / part, sbs.make_meta(CFG, tmp_path / part), part_results)
    merged = sbs.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")], tmp_path / "m")
    m = json.loads((tmp_path / "m.json").read_text())["contenders"]
    assert list(m) == ["dense", "deepspeed", "sliding"]
    assert m["sliding"]["rows"][0]["vs_deepspeed"] == 2.0
    assert "Merged from 2 separate invocations" in merged


def test_slideformer_rows_and_its_ratio(tmp_path):
    """SlideFormer's row of a size is its one micro-batch of the same tokens/step; ours is
    compared with it in the vs SlideFormer column."""
    runs = _runs()
    runs["slideformer"] = sbs.ChildRun(
        [dict(kind="info", gpu="Test GPU"), dict(_result(1, 8.0, mb=8), grad_accum=4),
         _result(1, 50.0), dict(kind="done")], 40 << 30, 50.0, 0, False, "")
    results = {n: sbs.collect(n, CFG, r, tmp_path / f"{n}.log") for n, r in runs.items()}
    table = sbs.write_outputs(tmp_path / "all", sbs.make_meta(CFG, tmp_path / "all"), results)
    data = json.loads((tmp_path / "all.json").read_text())["contenders"]
    assert list(data) == ["dense", "deepspeed", "slideformer", "sliding"]
    assert data["sliding"]["rows"][0]["vs_slideformer"] == 2.0
    assert [r["micro_batch"] for r in data["slideformer"]["rows"]] == [2, 8]
    assert "| SlideFormer's public code, cap 24 GiB |" in table


def test_slideformer_skips_without_cuda(tmp_path):
    data, _ = _run(tmp_path, "--contenders", "slideformer")
    entry = data["contenders"]["slideformer"]
    assert entry["status"] == "skipped" and "CUDA" in entry["skipped"]


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "sbs"
    proc = subprocess.run([sys.executable, str(BENCH / "side_by_side.py"), "--dry-run-cpu",
                           "--seq", "16", "--micro-batch", "1", "--grad-accum", "1", "2",
                           "--out", str(out), *args],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "sbs.json").read_text()), proc.stdout


def _check_rows(entry: dict) -> None:
    assert entry["status"] == "ok", entry
    assert [r["grad_accum"] for r in entry["rows"]] == [1, 2]
    for r in entry["rows"]:
        assert r["tokens_per_s"] > 0 and r["peak_rss_gib"] > 0 and r["bounding"]
        assert r["tokens_per_step"] == 16 * r["grad_accum"]
    assert entry["peak_rss_tree_gib"] > 0


def test_one_contender_process(tmp_path):
    """A real child process: records read past the marker, its log kept, the table written."""
    data, stdout = _run(tmp_path, "--contenders", "resident", "--warmup", "1", "--steps", "1")
    _check_rows(data["contenders"]["resident"])
    log = (tmp_path / "sbs.resident.log").read_text()
    assert MARK + '{"kind": "done"}' in log
    assert stdout.rstrip().endswith((tmp_path / "sbs.md").read_text().rstrip())


@pytest.mark.slow
def test_dry_run_cpu_all_contenders(tmp_path):
    """The whole flow without a GPU (~25 s on 2 cores): every contender and size, and our
    largest-micro-batch search under a tiny cap (the CPU cannot run out of VRAM: the +25% try
    just runs). DeepSpeed is skipped where it is not installed (and runs on its CPU
    accelerator where it is)."""
    data, _ = _run(tmp_path, "--max-batch", "--vram-cap", "0.001", "--ds-batches", "2")
    c = data["contenders"]
    for name in ("dense", "resident", "sliding"):
        _check_rows(c[name])
    assert c["deepspeed"]["status"] in ("skipped", "ok")
    if c["deepspeed"]["status"] == "ok":
        _check_rows(c["deepspeed"])
        assert all(r["optimizer_steps"] == 7 for r in c["deepspeed"]["rows"])
    tries = c["sliding"]["max_batch"]
    assert [t["expected"] for t in tries] == ["fits", "oom"]
    assert tries[0]["micro_batch"] == tries[0]["planner_max"] > 0 and tries[0]["tokens_per_s"] > 0
    assert tries[1]["micro_batch"] > tries[0]["micro_batch"]
    losses = [r["losses"][0] for n in ("dense", "resident", "sliding") for r in c[n]["rows"]]
    assert all(abs(x - 5.545) < 0.05 for x in losses)  # ln(256): each random init starts ~uniform
    table = (tmp_path / "sbs.md").read_text()
    assert table.count("| ours, sliding") == 2 + 2  # two sizes and two max-batch tries


def test_sliding_runs_a_process_per_size(tmp_path):
    """Our sliding contender runs each size in a process of its own (its peak RSS its own), and
    the rows, the log and the done marker come together as from one process."""
    data, _ = _run(tmp_path, "--contenders", "sliding", "--warmup", "1", "--steps", "1")
    entry = data["contenders"]["sliding"]
    _check_rows(entry)
    assert entry["status"] == "ok"
    log = (tmp_path / "sbs.sliding.log").read_text()
    assert log.count(MARK + '{"kind": "done"}') == len(entry["rows"]) == 2
    assert not list(tmp_path.glob("sbs.sliding.*.log"))  # the per-size logs were joined
