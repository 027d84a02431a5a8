"""The NVMe tier: moments on disk change nothing (bitwise), survive checkpoints, and fall back
to buffered I/O where O_DIRECT is refused."""
from __future__ import annotations

import errno
import fcntl
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec
from slideformer.engine.runtime import nvme
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.nvme import NvmeTier
from slideformer.engine.runtime.shapes import disk_layers
from slideformer.engine.runtime.shapes import file_bytes
from slideformer.engine.train.state import build_host_state, load_weights

STEPS = 3
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: tiny matmuls
SHAPE = ExecShape(micro_batch=1, seq_len=16, n_micro=1, slots=2)


@dataclass
class MB:
    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor | None = None


def batches(spec, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(SHAPE.n_micro):
            ids = torch.randint(0, spec.vocab_size, (1, SHAPE.seq_len), generator=g)
            labels = torch.randint(0, spec.vocab_size, (1, SHAPE.seq_len), generator=g)
            labels[torch.rand(1, SHAPE.seq_len, generator=g) < 0.3] = -100
            mbs.append(MB(ids, labels))
        out.append(mbs)
    return out


def hyper(k):
    return lambda coef: AdamHyper(2e-3 / k, 0.9, 0.999, 1e-8, 0.05, k, coef)


class Run:
    """Host state (+ tier) and executor of one run; ``steps(first, batches)`` trains."""

    def __init__(self, model, dtype, tier=None, threaded=False):
        self.spec, self.tier = load_spec(model), tier
        self.host = build_host_state(self.spec, CpuBackend(), dtype, torch.float32, tier)
        self.ex = SlidingExecutor(self.spec, CpuBackend(), self.host, SHAPE, dtype)
        if threaded:  # updates on a worker thread, as on CUDA: they overlap the next forward
            self.ex.updater = ThreadPoolExecutor(1, "cpu-adam")

    def steps(self, first, mbs_list, clip):
        outs = [self.ex.train_step(mbs, hyper(k), clip) for k, mbs in enumerate(mbs_list, first)]
        self.ex.drain()
        return outs

    def state(self):
        """Every item's checkpoint tensors, copied (bitwise comparisons)."""
        return {name: {k: t.clone() for k, t in item.state_tensors().items()}
                for name, item in self.host.items()}

    def close(self):
        self.ex.close()
        if self.tier is not None:
            self.tier.close()


def tier_for(folder, spec, fraction, **kw):
    layers = disk_layers(spec.num_layers, round(fraction * spec.num_layers))
    return NvmeTier(folder, [f"layer{i}" for i in layers], **kw)


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k].view(torch.uint8), b[name][k].view(torch.uint8)), f"{name}.{k}"


def test_disk_layers_are_spread_and_files_aligned():
    assert disk_layers(4, 0) == [] and disk_layers(4, 4) == [0, 1, 2, 3]
    assert disk_layers(4, 2) == [1, 3]  # spread: a RAM layer's update hides each read
    assert disk_layers(10, 3) == [3, 6, 9]
    assert file_bytes(1000, torch.bfloat16, torch.float32) == 2 * 4096
    assert file_bytes(1000, torch.bfloat16, torch.float32, remainders=True) == 3 * 4096
    assert file_bytes(1000, torch.float32, torch.bfloat16, remainders=True) == 2 * 4096  # no rem


@pytest.mark.parametrize("dtype,clip,full", [
    (torch.float32, 0.5, {"buffers": 1}),
    (torch.float32, 0.0, {"buffers": 2, "direct": False, "threaded": True}),
    (torch.bfloat16, 0.5, {"buffers": 3, "remainders": True, "threaded": True}),
    (torch.bfloat16, 0.0, {"buffers": 1, "remainders": True})],
    ids=["fp32-clip", "fp32-noclip-buffered", "bf16-clip-rem", "bf16-noclip-rem"])
def test_disk_moments_match_ram_bitwise(tiny_model_factory, tmp_path, dtype, clip, full):
    """0%, 50%, 100% of the layers' moments on disk: the same bits as the RAM-only run.

    bf16 compute runs the compiled CPU AdamW where a C compiler exists (the PyTorch-op chain
    otherwise); fp32 runs the PyTorch-op chain. The 100% run varies the pool (1 buffer for 4
    layers: every read takes a buffer back), the I/O mode, the remainders' place, and runs the
    updates on a worker thread as on CUDA.
    """
    model = tiny_model_factory("llama")
    spec = load_spec(model)
    data = batches(spec, STEPS)
    ram = Run(model, dtype)
    load_weights(ram.host, spec, model)
    ref = [(o.loss, o.grad_norm) for o in ram.steps(1, data, clip)]
    ref_state = ram.state()
    ram.close()
    assert ref_state["layer1"]["v"].abs().min() > 0  # the moments did change
    for fraction, kw in [(0.0, {}), (0.5, {"buffers": 2}), (1.0, full)]:
        kw = dict(kw)
        threaded = kw.pop("threaded", False)
        run = Run(model, dtype, tier_for(tmp_path, spec, fraction, **kw), threaded)
        load_weights(run.host, spec, model)
        outs = run.steps(1, data, clip)
        assert [(o.loss, o.grad_norm) for o in outs] == ref, (fraction, kw)
        assert_bitwise(run.state(), ref_state)
        disk = {s.item for o in outs for s in o.timeline.resolve() if s.lane == "disk"}
        assert disk == set(run.tier.files), (fraction, kw)
        assert run.tier.bytes_written >= STEPS * sum(f.nbytes for f in run.tier.files.values())
        if len(run.tier.files) > run.tier.n_buffers:  # some items were read back every step
            per_item = next(iter(run.tier.files.values())).nbytes
            assert run.tier.bytes_read >= STEPS * (len(run.tier.files) - run.tier.n_buffers) * per_item
        run.close()
    assert os.listdir(tmp_path) == []  # the files are unlinked at creation


@pytest.mark.parametrize("after", [1.0, 0.0], ids=["disk-to-disk", "disk-to-ram"])
def test_checkpoint_resume_continues_exactly(tiny_model_factory, tmp_path, after):
    """Save after step 2 (half the layers on disk), resume in a new tier and executor."""
    model = tiny_model_factory("llama")
    spec = load_spec(model)
    data = batches(spec, 4, seed=5)
    whole = Run(model, torch.bfloat16, tier_for(tmp_path, spec, 0.5, remainders=True))
    load_weights(whole.host, spec, model)
    ref = [o.loss for o in whole.steps(1, data, 1.0)]
    ref_state = whole.state()
    whole.close()

    first = Run(model, torch.bfloat16, tier_for(tmp_path, spec, 0.5, remainders=True, buffers=2))
    load_weights(first.host, spec, model)
    losses = [o.loss for o in first.steps(1, data[:2], 1.0)]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name, item in first.host.items():  # what both checkpoint writers do with state_tensors()
        save_file({k: v.contiguous() for k, v in item.state_tensors().items()},
                  str(ckpt / f"{name}.safetensors"))
    first.close()

    second = Run(model, torch.bfloat16, tier_for(tmp_path, spec, after, remainders=True, buffers=2))
    load_weights(second.host, spec, model)  # stale staging buffers that the load must replace
    for name, item in second.host.items():
        saved = load_file(str(ckpt / f"{name}.safetensors"))
        for k, dst in item.state_tensors().items():
            dst.copy_(saved[k])
    losses += [o.loss for o in second.steps(3, data[2:], 1.0)]
    assert losses == ref
    assert_bitwise(second.state(), ref_state)
    second.close()


def _make_items(tier, sizes):
    return [tier.place(f"layer{i}", n, {"m": torch.float32, "v": torch.bfloat16})
            for i, n in enumerate(sizes)]


SIZES = [5000, 1, 4097, 12345]


def _fill(items):
    for it in items:
        k = int(it.name.removeprefix("layer"))
        with it.staged(write=True) as t:
            t["m"].copy_(torch.arange(it.numel, dtype=torch.float32) * (k + 1))
            t["v"].copy_(-torch.arange(it.numel, dtype=torch.float32).to(torch.bfloat16) - k)


def _check(items):
    for it in items:
        k = int(it.name.removeprefix("layer"))
        with it.staged(write=False) as t:
            assert torch.equal(t["m"], torch.arange(it.numel, dtype=torch.float32) * (k + 1))
            assert torch.equal(t["v"], -torch.arange(it.numel, dtype=torch.float32).to(torch.bfloat16) - k)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_tier_round_trip_bounded_pool(tmp_path, monkeypatch, direct):
    """Odd sizes, several requests per item, 2 buffers for 4 items, unclaimed read-ahead."""
    monkeypatch.setattr(nvme, "IO_CHUNK", 8192)
    with NvmeTier(tmp_path, [f"layer{i}" for i in range(4)], buffers=2, direct=direct) as tier:
        items = _make_items(tier, SIZES)
        assert tier.bytes == sum(it.nbytes for it in items) and all(it.nbytes % 4096 == 0 for it in items)
        if not direct:
            assert tier.direct is False
        _fill(items)
        for it in items:  # read ahead of everything, claimed in the opposite order
            it.prefetch()
        _check(items[::-1])
        _check(items)
        assert tier._allocated == 2
        tier.flush()
        assert tier.bytes_read > 0 and tier.bytes_written >= sum(it.nbytes for it in items)
        # mapped tensors (checkpoints) and staged buffers see each other's writes
        maps = items[0].mapped()
        assert torch.equal(maps["m"], torch.arange(5000, dtype=torch.float32))
        maps["m"].fill_(7.0)
        del maps
        with items[0].staged(write=True) as t:
            assert (t["m"] == 7.0).all()
            t["v"].fill_(3.0)
        assert (items[0].mapped()["v"] == 3.0).all()
    assert os.listdir(tmp_path) == []


def _refuse_direct_open(real_open):
    def fake(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)
    return fake


def _refuse_direct_read(real_preadv):
    def fake(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)
    return fake


@pytest.mark.parametrize("refuse", ["open", "read"])
def test_buffered_fallback_where_o_direct_is_refused(tmp_path, monkeypatch, refuse):
    """EINVAL at open (tmpfs on older kernels) or on the first read: buffered files, same data."""
    if refuse == "open":
        monkeypatch.setattr(os, "open", _refuse_direct_open(os.open))
    else:
        monkeypatch.setattr(os, "preadv", _refuse_direct_read(os.preadv))
    with NvmeTier(tmp_path, [f"layer{i}" for i in range(4)], buffers=1) as tier:
        items = _make_items(tier, SIZES)
        assert tier.direct is False
        assert all(not fcntl.fcntl(it.fd, fcntl.F_GETFL) & os.O_DIRECT for it in items)
        _fill(items)
        _check(items)


def test_errors_name_the_folder_and_the_fix(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="is not a folder"):
        NvmeTier(tmp_path / "missing", ["layer0"])
    with pytest.raises(UserError, match="budget.nvme_size"):
        with NvmeTier(tmp_path, ["layer0", "layer1"], size_limit=50_000) as tier:
            _make_items(tier, [5000, 5000])
    with NvmeTier(tmp_path, ["layer0"]) as tier:
        item, = _make_items(tier, [5000])

        def failing(fd, buffers, offset):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(OSError, match="reading the optimizer state of layer0"):
            item.acquire()
        monkeypatch.undo()
        with pytest.raises(OSError):  # the tier stays failed: the run must stop
            tier.flush()
    assert os.listdir(tmp_path) == []


def test_concurrent_staging_keeps_every_update(tmp_path, monkeypatch):
    """Three threads update their own items through a 2-buffer pool while another prefetches at
    random: buffers are taken back and handed on, and no increment is lost."""
    monkeypatch.setattr(nvme, "IO_CHUNK", 8192)
    rounds, names = 30, [f"layer{i}" for i in range(6)]
    with NvmeTier(tmp_path, names, buffers=2) as tier:
        items = _make_items(tier, [3000 + 1000 * i for i in range(6)])

        def work(mine):
            for r in range(rounds):
                for it in mine:
                    with it.staged(write=True) as t:
                        t["m"] += 1
                        t["v"].fill_(r)

        def prefetch():
            g = torch.Generator().manual_seed(0)
            for _ in range(rounds * 6):
                items[int(torch.randint(0, 6, (), generator=g))].prefetch()

        threads = [threading.Thread(target=work, args=(items[k::3],)) for k in range(3)]
        threads.append(threading.Thread(target=prefetch))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tier.flush()
        for it in items:
            m = it.mapped()
            assert (m["m"] == rounds).all() and (m["v"] == rounds - 1).all(), it.name
