"""Where one decoder layer's time goes: forward, recompute + backward, by component.

Runs the engine's own layer maths (slideformer.engine.models.layers.decoder_layer, as the executor calls it:
forward without autograd, then recompute with autograd + backward from the same input) on random
bf16 weights of one layer of a model shape, for each micro-batch size and for plain causal and
packed-document attention. Prints one JSON line per case:

- ``forward_ms`` / ``recompute_backward_ms``: median wall time of the phase (CUDA events on the
  GPU), and the model TFLOP/s of the layer's matmuls and attention in it;
- ``components``: each component run alone on the layer's shapes and timed the same way, forward
  and forward + backward (the recompute + backward of that component): matmuls (the 7 F.linear),
  attention (SDPA as the layer calls it), rmsnorm (2 per layer), rope (q and k), swiglu
  (silu(gate) * up); ``other`` is the layer's time minus their sum (residual adds, reshapes,
  autograd's bookkeeping);
- ``attention``: forward + backward of attention alone with each kernel choice: SDPA with the
  boolean (B, 1, T, T) packed mask, SDPA causal (flash-eligible), and FlexAttention with a document
  BlockMask (CUDA only; its largest difference from the masked SDPA output is printed beside), for
  the same tokens.

Every case runs twice, ``kernels``: ``reference`` (``SLIDEFORMER_TRITON=0 SLIDEFORMER_FLEX=0``:
PyTorch RMSNorm, RoPE and SwiGLU, boolean-mask SDPA for packed documents) and ``fused`` (the
engine's default on CUDA: the Triton kernels of slideformer.engine.kernels and FlexAttention), so
each component's time is printed for the old and the new kernel side by side; ``launches``
counts the fused launches of the case (all zero for ``reference``, and on the CPU: a fused
row without launches fell back to PyTorch), and a ``reference_over_fused`` line after each pair
gives the speed-ups per phase and component.

    python benchmarks/layer_profile.py --shape llama-3.2-3b --micro-batch 8 64 --seq 1024
    python benchmarks/layer_profile.py --tiny      # CPU dry run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sliding_step import shape_spec  # noqa: E402
from slideformer.engine.kernels import attention as attn, dispatch  # noqa: E402
from slideformer.engine.models import layers  # noqa: E402
from slideformer.engine.kernels.attention import packed_causal_mask  # noqa: E402
from slideformer.engine.models.layers import rope_tables  # noqa: E402
from slideformer.engine.models.model import positions_for  # noqa: E402
from slideformer.engine.plan.bench import kernel_switches, layer_passes  # noqa: E402
from slideformer.engine.plan.speed import layer_flops  # noqa: E402
from slideformer.engine.runtime.executor import ExecShape  # noqa: E402

def random_layer(spec, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    flat = (torch.randn(spec.params_per_layer, generator=g) * 0.02).to(device, dtype)
    for name, off, shape in spec.layer_layout.entries:
        if len(shape) == 1:  # norm weights near one, biases small
            n = shape[0]
            flat[off:off + n] = 1.0 if "norm" in name else 0.0
    return spec.layer_layout.views(flat)


def inputs(spec, B, T, packed, device, dtype):
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    doc = None
    if packed:  # documents of 1/8 the sequence each, as packing short records gives
        doc = (torch.arange(T, device=device) // max(T // 8, 1)).expand(B, T).contiguous()
    rope = rope_tables(spec, positions_for(ids, doc), dtype)
    mask = None if doc is None else attn.document_mask(doc, spec.head_dim)
    x = torch.randn(B, T, spec.hidden_size, device=device, dtype=dtype)
    return x, rope, mask, doc


def timer(device):
    """A callable timing fn() in milliseconds (CUDA events on the GPU)."""
    def cuda(fn):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def cpu(fn):
        import time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return cuda if device.type == "cuda" else cpu


def median_ms(fn, device, reps):
    t = timer(device)
    for _ in range(2):
        t(fn)
    return statistics.median(t(fn) for _ in range(reps))


def components(spec, p, x, rope, mask, device, reps) -> dict[str, dict[str, float]]:
    """Each component alone on the layer's shapes: forward (ms) and forward + backward (ms), for
    the layer's total minus their sum ("other": residual adds, reshapes, autograd overhead)."""
    B, T, H = x.shape
    nh, nkv, hd, I = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    r = lambda *shape: torch.randn(*shape, device=x.device, dtype=x.dtype, requires_grad=True)  # noqa: E731
    h, q, k, v, g, u = r(B, T, H), r(B, nh, T, hd), r(B, nkv, T, hd), r(B, nkv, T, hd), r(B, T, I), r(B, T, I)
    a = r(B, T, nh * hd)
    w = {n: t.detach().requires_grad_() for n, t in p.items()}
    cos, sin = rope

    def matmuls():
        outs = [F.linear(h, w[f"self_attn.{n}_proj.weight"]) for n in "qkv"]
        outs.append(F.linear(a, w["self_attn.o_proj.weight"]))
        outs += [F.linear(h, w[f"mlp.{n}_proj.weight"]) for n in ("gate", "up")]
        outs.append(F.linear(g, w["mlp.down_proj.weight"]))
        return outs
    parts = {
        "matmuls": matmuls,
        "attention": lambda: [attn.attend(q, k, v, mask, mask is None, nh != nkv)],
        "rmsnorm": lambda: [layers.rms_norm(h, w["input_layernorm.weight"], spec.rms_norm_eps)
                            for _ in range(2)],  # two per layer
        "rope": lambda: [layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)],
        "swiglu": lambda: [layers.swiglu(g, u)]}
    out = {}
    for name, fn in parts.items():
        def fwd():
            with torch.no_grad():
                fn()

        def both():
            ys = fn()
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
        out[name] = {"forward_ms": round(median_ms(fwd, device, reps), 3),
                     "forward_backward_ms": round(median_ms(both, device, reps), 3)}
    return out


def attention_variants(spec, B, T, device, dtype, reps) -> dict[str, float]:
    """Forward + backward of attention alone (ms) per kernel choice, same packed documents."""
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(B, nh, T, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, nkv, T, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, nkv, T, hd, device=device, dtype=dtype, requires_grad=True)
    doc = (torch.arange(T, device=device) // max(T // 8, 1)).expand(B, T).contiguous()
    mask = packed_causal_mask(doc)
    gqa = nh != nkv

    def run(attn):
        def fn():
            attn().sum().backward()
        return round(median_ms(fn, device, reps), 3)
    out = {"sdpa_bool_mask_packed": run(lambda: F.scaled_dot_product_attention(
               q, k, v, attn_mask=mask, enable_gqa=gqa)),
           "sdpa_causal_plain": run(lambda: F.scaled_dot_product_attention(
               q, k, v, is_causal=True, enable_gqa=gqa))}
    if device.type == "cuda":  # the engine's own FlexAttention path (compiled once)
        bm = attn.document_block_mask(doc)
        out["flex_document_packed"] = run(lambda: attn.attend(q, k, v, bm, False, gqa))
        with torch.no_grad():  # the same maths as the masked SDPA it is timed against
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            out["flex_max_abs_diff_vs_sdpa"] = (attn.attend(q, k, v, bm, False, gqa)
                                                - ref).abs().max().item()
    return out


KERNELS = {"reference": False, "fused": True}
"""Each kernel choice: every switch off (``reference``) or the engine's default (``fused``)."""


def with_kernels(name: str, fn):
    """fn() with the switches of KERNELS[name] set (and the other ones cleared)."""
    with kernel_switches(KERNELS[name], KERNELS[name]):
        return fn()


def case(spec, B, T, packed, device, dtype, reps, kernels: str) -> dict:
    launches = dict(dispatch.LAUNCHES)
    p = random_layer(spec, device, dtype)
    x, rope, mask, _ = inputs(spec, B, T, packed, device, dtype)
    fwd, bwd = layer_passes(spec, p, x, rope, mask)
    f_flops, b_flops = layer_flops(spec, ExecShape(micro_batch=B, seq_len=T, n_micro=1, slots=2))
    f_ms, b_ms = median_ms(fwd, device, reps), median_ms(bwd, device, reps)
    parts = components(spec, p, x, rope, mask, device, reps)
    parts["other"] = {"forward_ms": round(f_ms - sum(c["forward_ms"] for c in parts.values()), 3),
                      "forward_backward_ms": round(b_ms - sum(c["forward_backward_ms"]
                                                              for c in parts.values()), 3)}
    ran = {k: n - launches.get(k, 0) for k, n in dispatch.LAUNCHES.items() if n > launches.get(k, 0)}
    return dict(micro_batch=B, seq=T, packed=packed, kernels=kernels, device=str(device),
                forward_ms=round(f_ms, 3), forward_tflops=round(f_flops / f_ms / 1e9, 1),
                recompute_backward_ms=round(b_ms, 3),
                recompute_backward_tflops=round(b_flops / b_ms / 1e9, 1), components=parts,
                launches=ran)


def speedup(ref: dict, fused: dict) -> dict:
    """Reference time over fused time per phase and per component (forward + backward)."""
    ratio = lambda a, b: round(a / b, 2) if b > 0 else None  # noqa: E731
    parts = {k: ratio(c["forward_backward_ms"], fused["components"][k]["forward_backward_ms"])
             for k, c in ref["components"].items() if k != "other"}
    return dict(micro_batch=ref["micro_batch"], seq=ref["seq"], packed=ref["packed"],
                reference_over_fused=dict(forward=ratio(ref["forward_ms"], fused["forward_ms"]),
                                          recompute_backward=ratio(ref["recompute_backward_ms"],
                                                                   fused["recompute_backward_ms"]),
                                          components_fwd_bwd=parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                    help="reference: PyTorch ops and boolean-mask SDPA; fused: Triton + FlexAttention")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on the tiny shape")
    a = ap.parse_args()
    if a.tiny:
        a.shape, a.micro_batch, a.seq, a.reps = "tiny", [2], 32, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = shape_spec(a.shape)
    for B in a.micro_batch:
        for packed in (False, True):
            rows = {}
            for kernels in a.kernels:
                rows[kernels] = with_kernels(kernels, lambda: case(spec, B, a.seq, packed, device,
                                                                   dtype, a.reps, kernels))
                print(json.dumps(rows[kernels]), flush=True)
            if len(rows) == 2:
                print(json.dumps(speedup(rows["reference"], rows["fused"])), flush=True)
        print(json.dumps(dict(micro_batch=B, seq=a.seq, attention_fwd_bwd_ms=attention_variants(
            spec, B, a.seq, device, dtype, a.reps))), flush=True)


if __name__ == "__main__":
    main()
