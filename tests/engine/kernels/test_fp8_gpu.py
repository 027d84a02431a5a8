"""FP8 on the GPU (slideformer.engine.kernels.fp8, kernels.triton_fp8): the row-wise
quantisation kernel against its PyTorch form, and the products against the CPU's reference.
(The CPU-side tests are tests/engine/runtime/test_fp8.py; they need a torch that emulates
``torch._scaled_mm`` on the CPU, which these do not.)"""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.kernels import fp8
from tests.engine.runtime.test_fp8 import operands

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or fp8.unsupported("cuda") is not None,
    reason="needs a GPU with FP8 tensor cores")]


@pytest.mark.parametrize("shape", [(64, 256), (70, 300), (5, 17), (4096, 3072)])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_quantisation_kernel_equals_its_pytorch_form(shape, transposed):
    """Scales and e4m3 values bit for bit, for row-major and transposed operands, ragged sizes,
    an all-zero row and an outlier."""
    from slideformer.engine.kernels.triton_fp8 import rowwise_e4m3
    g = torch.Generator("cuda").manual_seed(shape[0])
    t = (torch.randn(*shape, generator=g, device="cuda") * 3).bfloat16()
    a = t.t() if transposed else t  # a view: the zero row and the outlier are a's own
    a[1] = 0
    a[0, 0] = 900.0
    q, s = rowwise_e4m3(a)
    q_ref, s_ref = fp8.rowwise_torch(a)
    assert q.is_contiguous() and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_the_gpu_product_matches_the_reference():
    """On the GPU's FP8 tensor cores the forward and dL/dx equal the row-wise product written
    out in PyTorch (fp8.reference, on the CPU) up to fp32 accumulation order."""
    x, w, gy = operands(3, rows=(4, 64), k=128, n=256)
    xx = x.cuda().requires_grad_()
    y = fp8.linear(xx, w.cuda())
    y.backward(gy.cuda())
    torch.testing.assert_close(y.cpu(), fp8.reference(x, w), rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(xx.grad.cpu(), fp8.reference(gy.reshape(-1, 256), w.t()).view(x.shape),
                               rtol=2e-2, atol=1e-2)
