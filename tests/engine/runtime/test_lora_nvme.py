"""A frozen base on the NVMe tier (train.method lora / qlora) changes nothing: the same losses,
adapters and moments, bit for bit, as the base in RAM; the tier is written once while loading,
only read after that, and reads per step what the planner counts."""
from __future__ import annotations

import os

import pytest
import torch

from slideformer.engine.config import LoraConfig, OptimConfig
from slideformer.engine.models.lora import lora_spec
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.plan.frozen import base_reads, layer_bytes
from slideformer.engine.plan.memory import Precision
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime import nvme
from slideformer.engine.runtime.nvme import NvmeTier
from slideformer.engine.runtime.lora import adapter_name
from slideformer.engine.runtime.shapes import disk_layers, padded
from test_lora_equivalence import ALL, lora_host, run_lora  # noqa: E402
from test_sliding_equivalence import make_batches  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: tiny matmuls
LAYERS = 4
OPTIM = OptimConfig(lr=5e-3, weight_decay=0.1, schedule="cosine", warmup_steps=1,
                    max_grad_norm=0.5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama",
                        TinyShape(layers=LAYERS), seed=21)
    return load_spec(d), d


def adapters_state(spec, host):
    return [t for i in range(spec.num_layers) for t in
            (host[adapter_name(i)].w, host[adapter_name(i)].m, host[adapter_name(i)].v)]


@pytest.mark.parametrize("method,slots,packed,n_disk,buffers", [
    ("lora", 1, False, LAYERS, 3), ("lora", 2, True, 2, 3), ("qlora", 2, False, LAYERS, 1),
    ("qlora", 3, True, 3, 2), ("qlora", LAYERS, False, 2, 3)])
def test_base_on_disk_equals_base_in_ram(model, tmp_path, method, slots, packed, n_disk, buffers):
    spec, d = model
    lora = lora_spec(LoraConfig(rank=4, alpha=8.0, target_modules=ALL))
    shape = ExecShape(micro_batch=2, seq_len=12, n_micro=2, slots=slots)
    steps = make_batches(spec, n_micro=2, B=2, T=12, seed=22, packed=packed)[:3]
    nf4 = method == "qlora"
    ram = lora_host(spec, d, lora, nf4=nf4)
    ref = run_lora(spec, ram, lora, steps, OPTIM, shape)
    names = [f"layer{i}" for i in disk_layers(LAYERS, n_disk)]
    with NvmeTier(tmp_path, names, buffers=buffers) as tier:
        disk = lora_host(spec, d, lora, nf4=nf4, tier=tier)
        assert all(disk[n].w is None and disk[n].disk is not None for n in names)
        per = layer_bytes(spec, Precision(torch.float32, torch.float32), method)
        assert tier.bytes == tier.bytes_written == n_disk * padded(per)  # written once, at load
        got = run_lora(spec, disk, lora, steps, OPTIM, shape)
        assert tier.bytes_written == n_disk * padded(per)  # never written back
        for n in names:  # the weights read back are the loaded ones
            assert torch.equal(disk[n].master(), ram[n].master())
    assert got == ref
    for a, b in zip(adapters_state(spec, disk), adapters_state(spec, ram)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("slots,n_disk,buffers", [(1, 6, 2), (2, 5, 3), (3, 8, 3), (8, 4, 3)])
def test_reads_per_step_are_the_planned_ones(tmp_path, slots, n_disk, buffers):
    """From the third step on, a step reads what the planner counts
    (slideformer.engine.plan.frozen.base_reads), measured on the tier's byte counter."""
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=8, hidden=32, heads=2,
                                                           kv_heads=1, intermediate=48), seed=25)
    spec = load_spec(d)
    lora = lora_spec(LoraConfig(rank=2, target_modules="q_proj,down_proj"))
    disk = disk_layers(spec.num_layers, n_disk)
    (tmp_path / "nvme").mkdir()
    with NvmeTier(tmp_path / "nvme", [f"layer{i}" for i in disk], buffers=buffers) as tier:
        host = lora_host(spec, d, lora, tier=tier)
        per = tier.files[f"layer{disk[0]}"].nbytes
        ex = SlidingExecutor(spec, CpuBackend(), host,
                             ExecShape(micro_batch=1, seq_len=8, n_micro=1, slots=slots),
                             torch.float32, lora=lora)
        reads = []
        for k, mbs in enumerate(make_batches(spec, n_micro=1, B=1, T=8, seed=23)[:4], start=1):
            before = tier.bytes_read
            ex.train_step(mbs, lambda coef, k=k: AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, k, coef), 1.0)
            reads.append((tier.bytes_read - before) // per)
        ex.close()
        want = base_reads(spec.num_layers, slots, disk, buffers)
        assert reads[2:] == [want, want], reads
        assert tier.bytes_written == len(disk) * per
    if slots < 8:
        assert want > 0


def test_no_write_reaches_the_files_after_loading(model, tmp_path, monkeypatch):
    """After loading, the tier's I/O threads issue reads only (a counting wrapper around its
    transfer call), and the files' bytes stay those written while loading."""
    spec, d = model
    lora = lora_spec(LoraConfig(rank=2))
    with NvmeTier(tmp_path, ["layer0", "layer3"], buffers=1, direct=False) as tier:
        host = lora_host(spec, d, lora, nf4=True, tier=tier)
        files = [tier.files[n] for n in ("layer0", "layer3")]
        before = [os.pread(f.fd, f.nbytes, 0) for f in files]
        calls = {True: 0, False: 0}
        transfer = nvme._transfer

        def counting(fd, mv, offset, write):
            calls[write] += 1
            transfer(fd, mv, offset, write)
        monkeypatch.setattr(nvme, "_transfer", counting)
        run_lora(spec, host, lora, make_batches(spec, 1, B=1, T=8, seed=24)[:2], OPTIM,
                 ExecShape(micro_batch=1, seq_len=8, n_micro=1, slots=1))
        assert calls[False] > 0 and calls[True] == 0
        assert [os.pread(f.fd, f.nbytes, 0) for f in files] == before


def test_pin_sees_each_staging_buffer_once(model, tmp_path):
    """The tier hands every staging buffer it maps to ``pin`` (CudaBackend.pin_mapping page-locks
    them, so the copies to the GPU are asynchronous), and only those."""
    spec, d = model
    pinned = []
    with NvmeTier(tmp_path, ["layer1", "layer2", "layer3"], buffers=2, pin=pinned.append) as tier:
        host = lora_host(spec, d, lora_spec(LoraConfig(rank=2)), nf4=True, tier=tier)
        run_lora(spec, host, lora_spec(LoraConfig(rank=2)),
                 make_batches(spec, 1, B=1, T=8, seed=26)[:1], OPTIM,
                 ExecShape(micro_batch=1, seq_len=8, n_micro=1, slots=1))
        assert len(pinned) == tier._allocated == 2 and len({id(b) for b in pinned}) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("slots", [1, 3])
def test_gpu_qlora_base_on_disk_equals_base_in_ram(model, tmp_path, slots):
    """Under CUDA (async copies out of pinned staging buffers, bf16): the losses and adapters
    of the base in pinned RAM (within 1e-3: CUDA attention backward kernels may sum in another
    order from run to run; a copy read before it landed would differ by far more)."""
    from slideformer.engine.runtime.backend import CudaBackend
    from slideformer.engine.runtime.lora import init_adapters
    from slideformer.engine.train.state import build_frozen_state, load_weights
    spec, d = model
    lora = lora_spec(LoraConfig(rank=4, target_modules=ALL))
    steps = make_batches(spec, n_micro=2, B=2, T=12, seed=27)[:3]

    def run(tier):
        be = CudaBackend()
        host = build_frozen_state(spec, be, torch.bfloat16, torch.float32, lora, nf4=True,
                                  tier=tier)
        load_weights(host, spec, d)
        init_adapters({k: v for k, v in host.items() if k.startswith("lora")}, 0)
        ex = SlidingExecutor(spec, be, host, ExecShape(2, 12, 2, slots), torch.bfloat16, lora=lora)
        losses = [ex.train_step(mbs, lambda c, k=k: AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, k, c),
                                1.0).loss for k, mbs in enumerate(steps, start=1)]
        ex.close()
        state = [t.clone() for t in adapters_state(spec, host)]
        be.release_host()
        return losses, state

    ref = run(None)
    be = CudaBackend()
    with NvmeTier(tmp_path, [f"layer{i}" for i in range(LAYERS)], pin=be.pin_mapping) as tier:
        got = run(tier)
        be.release_host()
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-3, atol=0)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-5)
