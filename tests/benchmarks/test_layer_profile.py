"""benchmarks/layer_profile.py runs on the CPU (--tiny) and reports every phase and component."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_profile_reports_every_component():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_profile.py"), "--tiny"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=600).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    cases = [r for r in rows if "components" in r]
    assert [(r["packed"], r["kernels"]) for r in cases] == [
        (False, "reference"), (False, "fused"), (True, "reference"), (True, "fused")]
    assert all(r["launches"] == {} for r in cases)  # the CPU has no fused kernels to launch
    for r in cases:
        assert r["forward_ms"] > 0 and r["recompute_backward_ms"] > 0
        assert set(r["components"]) == {"matmuls", "attention", "rmsnorm", "rope", "swiglu", "other"}
        assert all(c["forward_backward_ms"] > 0 for k, c in r["components"].items() if k != "other")
    ratios = [r["reference_over_fused"] for r in rows if "reference_over_fused" in r]
    assert len(ratios) == 2 and all(x["recompute_backward"] > 0 for x in ratios)
    attn = [r["attention_fwd_bwd_ms"] for r in rows if "attention_fwd_bwd_ms" in r]
    assert attn and set(attn[0]) == {"sdpa_bool_mask_packed", "sdpa_causal_plain"}  # no flex on CPU
