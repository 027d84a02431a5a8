"""The planner's per-layer device transients against the CUDA allocator, per kernel path.

One decoder layer's forward without autograd and its recompute + backward (the executor's own
``_layer_backward``), and the LM head's step, each run on the GPU under every setting of
SLIDEFORMER_TRITON / SLIDEFORMER_FLEX, plain and packed: the peak of
``torch.cuda.max_memory_allocated`` above what was allocated before must match
slideformer.engine.plan.memory's prediction for the path ``kernel_path`` names, within the
tolerance of the CPU test (tests/engine/plan/test_plan_memory.py). Needs a CUDA GPU with triton.
"""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.kernels import attention
from slideformer.engine.kernels.dispatch import kernel_path
from slideformer.engine.kernels.linear_ce import linear_ce_fwd_bwd
from slideformer.engine.models.layers import decoder_layer, rms_norm, rope_tables
from slideformer.engine.models.model import positions_for
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config
from slideformer.engine.plan import memory as M
from slideformer.engine.plan import transients as TR
from slideformer.engine.plan.bench import kernel_switches
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MiB = 1 << 20
BF16, F32 = torch.bfloat16, torch.float32
# Llama-3.2-3B's proportions at half the width (GQA 12 / 4 heads of 128), and a Qwen3 layer
# (QK-norm); 4 x 1024 tokens per micro-batch.
LLAMA = dict(hidden=1536, heads=12, kv_heads=4, intermediate=4096, head_dim=128)
MHA = dict(LLAMA, kv_heads=12)
QWEN3 = dict(hidden=1024, heads=8, kv_heads=4, intermediate=3072, head_dim=128)
B, T = 4, 1024
# SDPA has no kernel for a boolean mask with grouped-query heads ahead of its math path (flash
# takes no mask, the memory-efficient kernel no GQA), which materialises (B, heads, T, T)
# scores: the planner counts only the additive mask, right for the memory-efficient kernel
# (checked on MHA). What the GQA rows measure says how far off that is.
GQA_MASK = pytest.mark.xfail(reason="boolean mask with GQA: SDPA's math path, not modelled",
                             strict=False)
PATHS = [(ops, att) for ops in ("fused", "torch") for att in ("causal", "flex", "mask")]
CASES = ([pytest.param("llama", LLAMA, None, ops, att, marks=[GQA_MASK] if att == "mask" else [])
          for ops, att in PATHS]
         + [("llama", MHA, None, ops, "mask") for ops in ("fused", "torch")]
         + [("llama", LLAMA, F32, "fused", att) for att in ("causal", "flex")]
         + [("qwen3", QWEN3, None, "fused", att) for att in ("causal", "flex")])


def _spec(arch, kw):
    return spec_from_config(tiny_config(arch, TinyShape(layers=1, vocab=32000, **kw)))


def _peak_above_base(fn) -> int:
    """Peak bytes allocated while fn ran, above what was allocated before (after a warm-up run
    that compiles the kernels and allocates the libraries' workspaces)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _close(part: str, predicted: int, measured: int) -> None:
    print(f"{part}: predicted {predicted / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB")  # -s
    # 6%, or a quarter MiB for the smallest terms, as the CPU test
    assert abs(predicted - measured) <= max(0.06 * measured, MiB / 4), (
        f"{part}: predicted {predicted / MiB:.1f} MiB, measured {measured / MiB:.1f} MiB")


def _inputs(spec, res, packed: bool):
    g = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn(spec.params_per_layer, generator=g)).to("cuda", BF16)
    doc = (torch.arange(T) // (T // 8)).expand(B, T).contiguous().cuda() if packed else None
    ids = torch.zeros(B, T, dtype=torch.long, device="cuda")
    rope = rope_tables(spec, positions_for(ids, doc), res)
    mask = None if doc is None else attention.document_mask(doc, spec.head_dim)
    x = torch.randn(B, T, spec.hidden_size, generator=g).to("cuda", res)
    gy = torch.randn(B, T, spec.hidden_size, generator=g).to("cuda", res)
    return w, x, gy, rope, mask


@pytest.mark.parametrize("arch,kw,res,ops,att", CASES)
def test_layer_transients_match_cuda_peaks(arch, kw, res, ops, att):
    spec = _spec(arch, kw)
    packed = att != "causal"
    with kernel_switches(ops == "fused", att == "flex"):
        path = kernel_path("cuda", spec.head_dim, packed)
        if path.key != f"{ops}+{att}":
            pytest.skip(f"{ops}+{att} is not available here (the run takes {path.key})")
        w, x, gy, rope, mask = _inputs(spec, res or BF16, packed)
        assert isinstance(mask, torch.Tensor) == (att == "mask")
        holder = type("Holder", (), {"spec": spec, "lora": None, "aux": (), "ff_tile": 0,
                                     "fp8": False,
                                     "_norm_views": lambda self, n, p: p})()
        slot_g = torch.zeros(w.numel(), device="cuda")

        def forward():
            with torch.no_grad():
                decoder_layer(spec, spec.layer_layout.views(w), x, rope, mask)

        def backward():
            SlidingExecutor._layer_backward(holder, w, slot_g, x, gy, rope, mask)
        measured = {"forward": _peak_above_base(forward), "backward": _peak_above_base(backward)}
    fwd, *bwd = TR.layer_transients(spec, B * T, B, T, M.Precision(BF16, F32, residual=res), path)
    wide = " fp32 residual" if res else ""
    name = f"{arch} {spec.num_heads}/{spec.num_kv_heads} heads {path.key}{wide}"
    _close(f"{name} forward", fwd.bytes, measured["forward"])
    _close(f"{name} recompute + backward", sum(a.bytes for a in bwd), measured["backward"])


@pytest.mark.parametrize("fused", [True, False])
def test_head_transients_match_cuda_peaks(fused):
    """head_step on one micro-batch: RMSNorm with autograd, the chunked loss and its grads."""
    spec = _spec("llama", LLAMA)
    shape = ExecShape(B, T, 1, 1, head_chunk=1024)
    with kernel_switches(fused, fused):
        path = kernel_path("cuda", spec.head_dim, False)
        if path.fused_ops != fused:
            pytest.skip("triton is not installed")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(B, T, spec.hidden_size, generator=g).to("cuda", BF16)
        ids = torch.randint(0, spec.vocab_size, (B, T), generator=g).cuda()
        head_w = 0.02 * torch.randn(spec.vocab_size, spec.hidden_size, generator=g)
        head_w = head_w.to("cuda", BF16)
        norm_w = torch.ones(spec.hidden_size, dtype=BF16, device="cuda")
        head_g = torch.zeros(spec.vocab_size, spec.hidden_size, device="cuda")

        def head():  # as SlidingExecutor.head_step does for one micro-batch
            xx, nw = x.detach().requires_grad_(), norm_w.detach().requires_grad_()
            with torch.enable_grad():
                h = rms_norm(xx, nw, spec.rms_norm_eps, BF16)
            _, gh = linear_ce_fwd_bwd(h.detach(), head_w, ids, 1.0, shape.head_chunk, head_g)
            torch.autograd.grad(h, [xx, nw], gh)
        measured = _peak_above_base(head)
    predicted = TR.head_scratch(spec, shape, M.Precision(BF16, F32), path.fused_ce, path.fused_ops,
                                fp32_grads=path.fp32_grads)
    _close(f"head ({path.key})", predicted.bytes, measured)


UNFUSED_FROZEN = pytest.mark.xfail(
    reason="the planner's frozen step on the PyTorch-ops path under-counts CUDA's peak: lora, host "
           "checkpoints measured 1872.6 MiB against 848.3 predicted on the H200 (2026-12-02); the "
           "CPU allocator's peaks match (test_plan_step_memory.py), so a CUDA-only temporary is "
           "missing from the model", strict=False)


@pytest.mark.parametrize("method,ckpt,fused", [
    ("lora", "gpu", True), ("qlora", "host", True),
    pytest.param("qlora", "gpu", False, marks=UNFUSED_FROZEN),
    pytest.param("lora", "host", False, marks=UNFUSED_FROZEN)])
def test_frozen_step_matches_cuda_peaks(method, ckpt, fused):
    """A whole train_step of a frozen-base run (train.method lora / qlora) on 8 layers of the
    Llama proportions above, 2 slots, 4 micro-batches of 4 x 1024 tokens: the executor's buffers
    and the step's peak (torch.cuda.max_memory_allocated above what was allocated before the
    executor, second step) against the planner's device rows without the CUDA context, the
    library workspaces and the allocator reserve; and the reserved memory within the planned
    total with the reserve."""
    from slideformer.engine.config import LoraConfig
    from slideformer.engine.models.lora import lora_spec
    from slideformer.engine.plan.evaluate import head_chunk
    from slideformer.engine.plan.frozen import frozen_allocations
    from slideformer.engine.runtime.backend import make_backend
    from slideformer.engine.runtime.host_state import AdamHyper
    from slideformer.engine.runtime.lora import init_adapters, is_adapter
    from slideformer.engine.train.state import build_frozen_state
    from tests.engine.runtime.test_sliding_equivalence import make_batches
    spec = spec_from_config(tiny_config("llama", TinyShape(layers=8, vocab=32000, **LLAMA)))
    shape = ExecShape(micro_batch=B, seq_len=T, n_micro=4, slots=2, checkpoints=ckpt,
                      head_chunk=head_chunk(spec.vocab_size))
    lora, backend = lora_spec(LoraConfig()), make_backend("cuda")
    with kernel_switches(fused, fused):
        path = kernel_path("cuda", spec.head_dim, False)
        if path.fused_ops != fused:
            pytest.skip("triton is not installed")
        host = build_frozen_state(spec, backend, BF16, F32, lora, nf4=method == "qlora")
        g = torch.Generator().manual_seed(0)
        for name, item in host.items():
            if not is_adapter(name):
                item.set_master(0.02 * torch.randn(item.numel, generator=g))
        init_adapters({k: v for k, v in host.items() if is_adapter(k)}, seed=0)
        steps = make_batches(spec, shape.n_micro, B=B, T=T, seed=1)
        x = torch.ones(64, 64, device="cuda", dtype=BF16)
        (x @ x).sum().item()  # the process's cuBLAS workspaces exist before the base is read
        torch.cuda.synchronize()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        ex = SlidingExecutor(spec, backend, host, shape, BF16, lora=lora)

        def hyper(coef):
            return AdamHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, 1, coef)
        ex.train_step(steps[0], hyper, 1.0)  # compiles kernels, allocates library workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ex.train_step(steps[1], hyper, 1.0)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        reserved = torch.cuda.max_memory_reserved() - base_reserved
        ex.close()
        backend.release_host()  # else each case's pinned state stays registered
    allocs = frozen_allocations(spec, shape, M.Precision(BF16, F32), "cuda", False, method, lora)
    # the context and the library workspaces are the process's (the workspaces predate `base`)
    tensors = [a for a in allocs
               if a.purpose not in ("CUDA context", "cuBLAS workspaces", "allocator reserve")]
    predicted = M.peak(tensors, ("gpu",))
    with_reserve = M.peak([a for a in allocs if a.purpose != "CUDA context"], ("gpu",))
    print(f"{method} {ckpt} {path.key}: reserved {reserved / MiB:.1f} MiB, planned with the "
          f"reserve {with_reserve / MiB:.1f} MiB")  # -s
    _close(f"{method} step, checkpoints on {ckpt}, {path.key}", predicted, measured)
    assert reserved <= with_reserve
