"""The backends and the NVMe tier implement the runtime's protocols (slideformer.engine.runtime.
protocols): every member is there, with the protocol's parameters."""
from __future__ import annotations

import inspect

import pytest
import torch

from slideformer.engine.runtime import protocols as P
from slideformer.engine.runtime.backend import CpuBackend, CudaBackend
from slideformer.engine.runtime.nvme import DiskItem, NvmeTier


def members(proto) -> list[str]:
    """The protocol's own and inherited public members (methods and annotated attributes)."""
    names: set[str] = set()
    for klass in proto.__mro__:
        if klass is object or klass.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        names |= set(getattr(klass, "__annotations__", {}))
    return sorted(names)


def assert_signatures(impl: type, proto) -> None:
    """Each protocol method exists on ``impl`` and takes the same parameters by name."""
    for name in members(proto):
        want = getattr(proto, name, None)
        if not callable(want):
            continue
        got = getattr(impl, name, None)
        assert callable(got), f"{impl.__name__}.{name} is missing"
        params = lambda f: [p for p in inspect.signature(f).parameters if p != "self"]  # noqa: E731
        assert params(got) == params(want), f"{impl.__name__}.{name}{inspect.signature(got)}"


@pytest.mark.parametrize("impl", [CpuBackend, CudaBackend])
def test_backends_have_every_backend_call(impl):
    assert_signatures(impl, P.Backend)
    assert isinstance(getattr(impl, "is_cuda", None), bool)


def test_the_cpu_backend_and_its_handles_conform():
    be = CpuBackend()
    assert isinstance(be, P.Backend)
    copy = be.start_h2d(torch.zeros(3), torch.ones(3))
    assert isinstance(copy, P.CopyHandle) and isinstance(copy.start, P.Handle)
    assert isinstance(be.mark(), P.Handle)


def test_something_missing_a_call_is_not_a_backend():
    class NoWaits:
        device, is_cuda = torch.device("cpu"), False
        alloc = host_alloc = start_h2d = start_d2h = mark = keep_alive = CpuBackend.alloc
        release_host = peak_memory = reset_peak = CpuBackend.alloc
    assert not isinstance(NoWaits(), P.Backend)
    with pytest.raises(AssertionError, match="compute_waits is missing"):
        assert_signatures(NoWaits, P.Backend)


@pytest.mark.gpu
def test_the_cuda_backend_conforms():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    be = CudaBackend()
    assert isinstance(be, P.Backend)
    copy = be.start_h2d(torch.zeros(3, device=be.device), torch.ones(3))
    assert isinstance(copy, P.CopyHandle) and isinstance(be.mark(), P.Handle)
    copy.wait()


def test_the_nvme_tier_and_its_files_conform(tmp_path):
    assert_signatures(NvmeTier, P.DiskTier)
    assert_signatures(DiskItem, P.DiskFile)
    with NvmeTier(tmp_path, ["layer1"], direct=False) as tier:
        assert isinstance(tier, P.DiskTier)
        fields = {"m": torch.float32, "v": torch.float32}
        assert tier.place("layer0", 10, fields) is None
        item = tier.place("layer1", 10, fields)
        assert isinstance(item, P.DiskFile) and item.fields == ("m", "v")
        with item.staged(write=True) as staged:
            staged["m"].fill_(2.0)
        tier.flush()
        assert torch.equal(item.mapped()["m"], torch.full((10,), 2.0))
