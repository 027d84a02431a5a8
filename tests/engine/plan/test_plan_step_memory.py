"""The planner's device rows of a whole training step against what the executor really
allocates (CPU), for a frozen base (train.method lora / qlora) and a trained one.

Persistent rows of a frozen-base run against the executor's own buffers, byte for byte; the
step's transients (the "step" rows and the largest of the dequantisation, forward, head and
backward parts) against the peak of live tensors PyTorch's allocator reports over a whole
train_step of the executor (profiler memory events), after a warm-up step, over both checkpoint
placements, NF4 and bf16 / fp32 bases, several micro-batches, LM-head chunks and vocabularies.
"""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.config import LoraConfig
from slideformer.engine.models.lora import lora_spec
from slideformer.engine.plan import memory as M
from slideformer.engine.plan.frozen import frozen_allocations
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.lora import init_adapters, is_adapter
from slideformer.engine.train.state import build_frozen_state, build_host_state
from tests.engine.plan.test_plan_memory import MiB, _nbytes, _peak_live, _rows, _spec
from tests.engine.runtime.test_sliding_equivalence import make_batches

F32, BF16 = torch.float32, torch.bfloat16
SHAPE = dict(hidden=256, heads=4, kv_heads=2, intermediate=688)


def frozen_run(method: str, dtype, shape: ExecShape, dropout: float = 0.0, layers: int = 3,
               vocab: int = 4000):
    """(spec, lora, host state, executor) of a small frozen-base run with random weights."""
    spec = _spec("llama", layers=layers, **SHAPE, vocab=vocab)
    lora = lora_spec(LoraConfig(dropout=dropout))
    host = build_frozen_state(spec, CpuBackend(), dtype, F32, lora, nf4=method == "qlora")
    g = torch.Generator().manual_seed(0)
    for name, item in host.items():
        if not is_adapter(name):
            item.set_master(0.02 * torch.randn(item.numel, generator=g))
    init_adapters({k: v for k, v in host.items() if is_adapter(k)}, seed=0)
    ex = SlidingExecutor(spec, CpuBackend(), host, shape, dtype, lora=lora)
    return spec, lora, host, ex


def _hyper(coef: float) -> AdamHyper:
    return AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, coef)


def step_peak(allocs) -> int:
    """The planner's step transients: the step rows and the largest part."""
    def s(phase: str) -> int:
        return sum(a.bytes for a in allocs if a.tier == "gpu" and a.phase == phase)
    return s("step") + max(s(p) for p in M.STEP_PARTS)


@pytest.mark.parametrize("method,dtype,ckpt", [("qlora", BF16, "gpu"), ("qlora", F32, "host"),
                                               ("lora", BF16, "host"), ("lora", F32, "gpu")])
def test_persistent_rows_are_the_executor_buffers(method, dtype, ckpt):
    shape = ExecShape(micro_batch=2, seq_len=32, n_micro=2, slots=2, checkpoints=ckpt, head_chunk=64)
    spec, lora, host, ex = frozen_run(method, dtype, shape)
    allocs = frozen_allocations(spec, shape, M.Precision(dtype, F32), "cpu", False, method, lora)
    assert _rows(allocs, "parameter slots") == _nbytes(*(s.buf for s in ex.pool.slots))
    assert _rows(allocs, "embedding weights", "head weights") == _nbytes(ex.embed_w, ex.head_w)
    if method == "qlora":
        assert _rows(allocs, "dequantised layer") == _nbytes(ex.scratch)
    else:
        assert not any(a.purpose == "dequantised layer" for a in allocs)
    if ckpt == "host":
        assert _rows(allocs, "checkpoint staging") == _nbytes(ex.store.staging)
        assert _rows(allocs, "pinned activation checkpoints") == _nbytes(ex.store.host)
    else:
        assert _rows(allocs, "activation checkpoints") == _nbytes(ex.store.buf)
    # a frozen base allocates no gradient buffers for itself
    assert ex.embed_g is None and ex.head_g is None and not ex.gslots
    assert not any("grads" in a.purpose and a.phase in ("state", "run") for a in allocs)
    ex.close()


CASES = [  # method, compute dtype, checkpoints, micro-batch, seq, micro-batches, LM-head chunk,
    # vocabulary (a small one: the layers' scratch outweighs the LM head's, as in large models)
    ("qlora", BF16, "gpu", 2, 64, 2, 4096, 4000), ("qlora", BF16, "host", 4, 64, 1, 128, 4000),
    ("qlora", F32, "gpu", 2, 128, 3, 128, 4000), ("lora", BF16, "gpu", 4, 64, 2, 4096, 4000),
    ("lora", F32, "host", 2, 128, 2, 4096, 4000), ("lora", BF16, "host", 2, 96, 3, 64, 4000),
    ("qlora", F32, "gpu", 4, 128, 4, 128, 256), ("qlora", BF16, "host", 4, 64, 2, 256, 256),
    ("lora", F32, "gpu", 4, 128, 4, 128, 256), ("lora", F32, "host", 4, 128, 3, 512, 256)]


@pytest.mark.parametrize("method,dtype,ckpt,B,T,n,chunk,vocab", CASES)
def test_step_transients_match_the_allocator_peak(method, dtype, ckpt, B, T, n, chunk, vocab):
    shape = ExecShape(micro_batch=B, seq_len=T, n_micro=n, slots=2, checkpoints=ckpt, head_chunk=chunk)
    spec, lora, host, ex = frozen_run(method, dtype, shape, vocab=vocab)
    steps = make_batches(spec, n, B=B, T=T, seed=1)
    ex.train_step(steps[0], _hyper, 1.0)  # the first step pushes the adapters to the device
    measured = _peak_live(lambda: ex.train_step(steps[1], _hyper, 1.0))
    ex.close()
    allocs = frozen_allocations(spec, shape, M.Precision(dtype, F32), "cpu", False, method, lora)
    predicted = step_peak(allocs)
    # as the per-layer terms (tests/engine/plan/test_plan_memory.py): 6%, or a quarter MiB
    assert abs(predicted - measured) <= max(0.06 * measured, MiB / 4), (
        f"predicted {predicted / MiB:.2f} MiB, measured {measured / MiB:.2f} MiB")


def test_adapter_dropout_is_counted():
    """Dropout saves each target's keep mask and dropped input: counted whole (an upper bound:
    some are freed before the MLP's backward peaks), within 15% above."""
    for method, dtype, ckpt, T in (("lora", BF16, "gpu", 64), ("qlora", F32, "host", 128)):
        shape = ExecShape(micro_batch=4, seq_len=T, n_micro=2, slots=2, checkpoints=ckpt,
                          head_chunk=128)
        spec, lora, host, ex = frozen_run(method, dtype, shape, dropout=0.1, vocab=256)
        steps = make_batches(spec, 2, B=4, T=T, seed=1)
        ex.train_step(steps[0], _hyper, 1.0)
        measured = _peak_live(lambda: ex.train_step(steps[1], _hyper, 1.0))
        ex.close()
        allocs = frozen_allocations(spec, shape, M.Precision(dtype, F32), "cpu", False, method, lora)
        assert measured <= step_peak(allocs) <= 1.15 * measured, (step_peak(allocs), measured)


@pytest.mark.parametrize("dtype,ckpt,B,T,n,chunk,vocab,clip", [
    (F32, "gpu", 4, 128, 4, 128, 256, 1.0), (F32, "host", 4, 128, 3, 512, 256, 0.0),
    (BF16, "gpu", 2, 64, 2, 4096, 4000, 1.0)])
def test_trained_step_transients_match_the_allocator_peak(dtype, ckpt, B, T, n, chunk, vocab, clip):
    """The same for full fine-tuning: the hidden states and their gradients, each layer's
    weight grads and the LM head's dL/dW."""
    spec = _spec("llama", layers=3, **SHAPE, vocab=vocab)
    shape = ExecShape(micro_batch=B, seq_len=T, n_micro=n, slots=2, checkpoints=ckpt,
                      head_chunk=chunk)
    host = build_host_state(spec, CpuBackend(), dtype, F32, layer_grads=clip > 0)
    g = torch.Generator().manual_seed(0)
    for item in host.values():
        item.set_master(0.02 * torch.randn(item.numel, generator=g))
    ex = SlidingExecutor(spec, CpuBackend(), host, shape, dtype)
    steps = make_batches(spec, n, B=B, T=T, seed=1)
    ex.train_step(steps[0], _hyper, clip)
    measured = _peak_live(lambda: ex.train_step(steps[1], _hyper, clip))
    ex.close()
    predicted = step_peak(M.allocations(spec, shape, M.Precision(dtype, F32), "cpu", False,
                                        clip=clip > 0))
    assert abs(predicted - measured) <= max(0.06 * measured, MiB / 4), (
        f"predicted {predicted / MiB:.2f} MiB, measured {measured / MiB:.2f} MiB")
