"""Host memory of the runtime itself, stage by stage: what plan.memory.HOST_RUNTIME stands for.

A training process holds, beyond its tensors, the Python interpreter, torch's libraries, the
CUDA context and whatever JIT compilers the run's kernels start. This prints the process's RSS
(and its growth) after each stage that loads something, in the order a CUDA training run meets
them, on tensors too small to count:

  import        torch and the engine imported
  cuda          a CUDA context, a bf16 matmul (cuBLAS) and SDPA
  triton        the fused Triton ops (RMSNorm, RoPE, SwiGLU: kernels.dispatch) compiled and run
  flex          FlexAttention with a document BlockMask (torch.compile: Inductor)
  cpu_adam      the native CPU AdamW (kernels.cpu_adam), fp32 then 8-bit moments
  nf4           the Triton NF4 dequantisation

    python benchmarks/host_baseline.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
_proc = psutil.Process()
_last = [0]


def stage(name: str) -> None:
    rss = _proc.memory_info().rss
    print(json.dumps({"stage": name, "rss_gib": round(rss / 2**30, 3),
                      "grew_mib": round((rss - _last[0]) / 2**20, 1)}), flush=True)
    _last[0] = rss


def main() -> None:
    stage("python")
    import torch
    import torch.nn.functional as F

    from slideformer.engine.kernels import attention, dispatch
    from slideformer.engine.models import layers
    from slideformer.engine.models.spec import Layout
    from slideformer.engine.plan.bench import adam_params_per_s
    from slideformer.engine.runtime.nf4 import Nf4Layout
    stage("import")
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA GPU"}))
        return
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
    stage("cuda")
    if dispatch.triton_enabled():
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
        layers.rms_norm(x, w, 1e-6)
        layers.swiglu(x, x)
        torch.cuda.synchronize()
        stage("triton")
        doc = torch.zeros(1, 256, dtype=torch.long, device="cuda")
        if attention.flex_available("cuda", 128):
            mask = attention.document_mask(doc, 128)
            attention.attend(q, q, q, mask, False, False).sum().item()
            stage("flex")
    adam_params_per_s(numel=1 << 20)
    stage("cpu_adam")
    layout = Layout.build([("w", (64, 4096))])
    nf = Nf4Layout.build(layout, torch.bfloat16)
    buf = nf.quantize(torch.randn(layout.numel, device="cuda"),
                      torch.empty(nf.nbytes, dtype=torch.uint8, device="cuda"))
    nf.dequantize(buf, torch.empty(layout.numel, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    stage("nf4")


if __name__ == "__main__":
    main()
