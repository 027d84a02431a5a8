"""8-bit AdamW moments on CUDA: the device items' PyTorch path stores the CPU reference's bytes,
and a sliding bf16 run with 8-bit moments (host items on the compiled kernel, the embedding,
head and first layers updated on the GPU) follows the fp32-moment run. Run on the reference GPU
machine."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.models.weights import item_names
from slideformer.engine.runtime.backend import CudaBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, DeviceItem, adam_update
from slideformer.engine.runtime.shapes import DEVICE_CHUNK, device_items
from slideformer.engine.train.state import build_host_state, load_weights
from tests.engine.runtime.test_moments_int8 import make_item, wide_values
from tests.engine.runtime.test_sliding_equivalence import make_batches

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("gpu8") / "m", "llama",
                        TinyShape(layers=6, hidden=256, heads=8, kv_heads=2, intermediate=704,
                                  vocab=384), seed=3)
    return load_spec(d), d


def test_device_update_stores_the_reference_bytes():
    """beta1 = beta2 = 0: the step's moments are g and g^2 exactly on both devices, so the GPU's
    requantise must write the CPU reference's bytes."""
    ref, _ = make_item(1 << 16)
    host, _ = make_item(1 << 16)
    grad = wide_values(ref.numel, 2, True)
    ref.g.copy_(grad)
    dev = DeviceItem(host, lambda n, dt: torch.zeros(n, dtype=dt, device="cuda"))
    dev.push()
    dev.g.copy_(grad)
    hp = AdamHyper(1e-3, 0.0, 0.0, 1e-8, 0.1, 1, 1.0)
    adam_update(ref, hp, AdamWorkspace(), native=False)
    adam_update(dev, hp, AdamWorkspace(DEVICE_CHUNK, "cuda"), native=False)
    dev.pull()
    assert torch.equal(host.m, ref.m) and torch.equal(host.v, ref.v)
    assert ((host.master() - ref.master()).norm() / ref.master().norm()) < 1e-6


def _run(spec, d, moments, shape):
    be = CudaBackend()
    host = build_host_state(spec, be, torch.bfloat16, moments,
                            on_device=device_items(shape, spec.num_layers))
    load_weights(host, spec, d)
    start = {name: host[name].master() for name in item_names(spec)}
    ex = SlidingExecutor(spec, be, host, shape, torch.bfloat16)
    losses = []
    for k, mbs in enumerate(make_batches(spec, shape.n_micro, seed=9), start=1):
        hyper = lambda c, k=k: AdamHyper(2e-3, 0.9, 0.999, 1e-8, 0.1, k, c)  # noqa: E731
        losses.append(ex.train_step(mbs, hyper, 1.0).loss)
    ex.drain()
    ex.close()
    masters = {name: host[name].master() for name in item_names(spec)}
    be.release_host()
    return losses, start, masters


def test_sliding_run_with_8bit_moments_follows_fp32_moments(model):
    spec, d = model
    shape = ExecShape(micro_batch=2, seq_len=24, n_micro=2, slots=2, device_update=True,
                      device_layers=2)
    l32, start, w32 = _run(spec, d, torch.float32, shape)
    l8, _, w8 = _run(spec, d, torch.int8, shape)
    print("losses fp32", l32, "int8", l8)
    assert max(abs(a - b) / a for a, b in zip(l32, l8)) < 0.01
    for name in w32:  # how far the int8 run lands, against how far the fp32 run moved
        dist = ((w8[name] - w32[name]).norm() / (w32[name] - start[name]).norm()).item()
        print(name, f"{dist:.3f}")
        assert dist < 0.3, name
