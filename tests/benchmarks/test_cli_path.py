"""benchmarks/cli_path.py --tiny: ``slideformer train`` on a packed JSONL file and the harness
run on the CPU in one invocation, and the CLI's per-step figures come from its events.jsonl."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_dry_run_times_the_cli_and_the_harness():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cli_path.py"), "--tiny"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=600).stdout
    lines = out.strip().splitlines()
    cli, harness = json.loads(lines[0]), json.loads(lines[1])
    assert cli["run"] == "cli" and len(cli["steps"]) == 4  # --tiny: 4 steps, stopped after them
    assert [s["step"] for s in cli["steps"]] == [1, 2, 3, 4]
    # packed rows of 2 x 64 tokens, 2 micro-batches: at most 256 tokens a step
    assert all(0 < s["tokens"] <= 256 and s["tokens_per_s"] > 0 for s in cli["steps"])
    # the part of each step spent on its micro-batches, and the norm that says if it clipped
    assert all(0 <= s["data_time"] < s["step_time"] and s["grad_norm"] > 0 for s in cli["steps"])
    # the harness counts a timed step (after its one warm-up step) as clipped when its norm
    # exceeded the limit of 1.0
    assert len(harness["grad_norms"]) == 4
    assert harness["clipped_steps"] == sum(n > 1.0 for n in harness["grad_norms"][1:])
    assert harness["run"] == "harness" and len(harness["step_times_s"]) == 4
    assert lines[-1].startswith("CLI / harness: ")
    # a late step's lanes from each run's timeline (the CLI's from its events.jsonl)
    assert cli["timeline"]["step"] in (3, 4) and cli["timeline"]["compute"] > 0  # 4: the run ended
    # before the poll stopped it, and emitted its last timeline
    assert harness["timeline"]["compute"] > 0
    # the executor each ran (the CLI's from its log): the same plan for the same shape
    assert cli["executor"] == harness["executor"] and "slots" in cli["executor"]
