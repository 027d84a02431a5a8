"""What a target speed needs, from a measured GPU-bound run: the FLOPs per token with and without
the layers' recompute, the matmul rate the target needs, and what keeping activations instead of
recomputing them would cost in host RAM and PCIe (issue 21's 1.2x SlideFormer at 64K).

    python benchmarks/ceiling.py [--shape llama-3.2-3b] [--tokens 65536] [--seq 1024] \\
        [--measured 23382] [--busy 0.964] [--target 27878] [--rss 61.9] \\
        [--hardware tests/fixtures/hardware/h200.json]

Defaults: the 64K row of benchmarks/RESULTS.md "2026-12-02 (second session)" (ours 23,382 tok/s,
GPU busy 2.70 of 2.80 s, 61.9 GiB RSS; 1.2x SlideFormer's 23,232 = 27,878) and the reference
machine's measured profile. The model: the step is GPU-bound, so its time scales with the GPU's
FLOPs; keeping a layer's activations removes its recompute and adds its saved tensors to the
host (the VRAM cap holds the window, not activations) and to PCIe, both ways.

Counted per token and decoder layer (P: its projection weights; bf16 unless said): the forward's
matmuls 2 P and attention
2 T q_dim (causal: half the scores), the backward 4 P and 2.5x the attention's forward (flash
recomputes the scores), the recompute 2 (P - P_down) plus the attention's forward (the executor
forms no layer output: docs/design/speed.md 6.2a); the LM head 6 V H. What the backward reads
when nothing is recomputed: the layer input, q, k, v, the attention output (+ fp32 lse), the
residual after attention, gate and up (the norms' outputs and silu(gate) * up are elementwise
and cheap to form again), two fp32 rstd rows.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sliding_step import SHAPES, shape_spec  # noqa: E402

GIB = 1 << 30


@dataclass(frozen=True)
class Flops:
    """FLOPs per token."""
    forward: float
    backward: float
    recompute: float
    """Of all decoder layers."""
    recompute_mlp: float
    """The part of ``recompute`` that keeping only the MLP's inputs saves: the output projection
    (the residual after attention is kept), gate and up; the attention's backward still needs
    q, k, v and its output recomputed."""

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


def matmul_params(spec) -> int:
    """A decoder layer's projection weights (its 2-D tensors; norms and biases are not matmuls)."""
    return sum(math.prod(s) for _, _, s in spec.layer_layout.entries if len(s) == 2)


def flops_per_token(spec, seq: int) -> Flops:
    L, H, I = spec.num_layers, spec.hidden_size, spec.intermediate_size
    P, q_dim = matmul_params(spec), spec.num_heads * spec.head_dim
    att = 2.0 * seq * q_dim
    head = 2.0 * spec.vocab_size * H
    return Flops(forward=L * (2 * P + att) + head, backward=L * (4 * P + 2.5 * att) + 2 * head,
                 recompute=L * (2 * (P - H * I) + att), recompute_mlp=L * 2 * (2 * H * I + q_dim * H))


def saved_bytes_per_token(spec, mlp_only: bool = False) -> int:
    """One decoder layer's tensors the backward reads when nothing is recomputed (``mlp_only``:
    only the MLP's: the residual after attention, gate and up)."""
    H, I = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if mlp_only:
        return 2 * (H + 2 * I) + 4
    return 2 * (H + q + 2 * kv + q + H + 2 * I) + 4 * spec.num_heads + 8


def analyse(spec, tokens: int, seq: int, measured: float, busy: float, target: float,
            rss_gib: float, hw: dict) -> dict:
    f = flops_per_token(spec, seq)
    L, P = spec.num_layers, spec.params_per_layer
    need = f.total * measured / target  # FLOPs/token the GPU may spend at the target speed
    out = dict(
        flops_per_token_g=round(f.total / 1e9, 2), recompute_share=round(f.recompute / f.total, 3),
        measured_tflops=round(f.total * measured / busy / 1e12, 1),
        target_tflops_with_recompute=round(f.total * target / busy / 1e12, 1),
        matmul_peak_tflops=round(hw["matmul_tflops"], 1),
        best_without_recompute=round(measured * f.total / (f.total - f.recompute)),
        best_mlp_only=round(measured * f.total / (f.total - f.recompute_mlp)))
    out["target_over_peak"] = round(out["target_tflops_with_recompute"] / out["matmul_peak_tflops"], 3)
    frac = (f.total - need) / f.recompute
    out["layers_to_keep"] = None if frac > 1 else max(0, math.ceil(frac * L))
    if out["layers_to_keep"]:
        n, step = out["layers_to_keep"], tokens / target
        kept = n * tokens * saved_bytes_per_token(spec)
        # H2D: every layer's weights in the forward and again in the backward (L > slots);
        # D2H: every layer's fp32 gradient; and the kept activations, both ways
        weights, grads = 2 * L * P * 2, L * P * 4
        duplex = hw["duplex_gbs"] * 1e9
        out.update(kept_gib=round(kept / GIB, 1), host_gib=round(rss_gib + kept / GIB, 1),
                   machine_ram_gib=round(hw["ram_total"] / GIB, 1),
                   h2d_s=round((weights + kept) / duplex, 2), d2h_s=round((grads + kept) / duplex, 2),
                   target_step_s=round(step, 2))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="llama-3.2-3b")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per optimizer step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--measured", type=float, default=23382, help="our measured tok/s")
    ap.add_argument("--busy", type=float, default=2.70 / 2.80, help="GPU busy share of its step")
    ap.add_argument("--target", type=float, default=1.2 * 23232, help="tok/s to reach")
    ap.add_argument("--rss", type=float, default=61.9, help="our measured peak RSS, GiB")
    ap.add_argument("--hardware", type=Path,
                    default=Path(__file__).resolve().parents[1] / "tests/fixtures/hardware/h200.json")
    a = ap.parse_args(argv)
    hw = json.loads(a.hardware.read_text())
    print(json.dumps(analyse(shape_spec(a.shape), a.tokens, a.seq, a.measured, a.busy, a.target,
                             a.rss, hw), indent=1))


if __name__ == "__main__":
    main()
