"""kernels.triton_nf4 against the PyTorch form of Nf4Layout.dequantize (runtime.nf4).

On CUDA; without a GPU under the Triton interpreter (fp32 and fp16 only)::

    TRITON_INTERPRET=1 python -m pytest tests/engine/kernels/test_triton_nf4.py -m gpu
"""
from __future__ import annotations

import os

import pytest
import torch

from slideformer.engine.kernels import dispatch
from slideformer.engine.models.spec import Layout
from slideformer.engine.runtime.nf4 import Nf4Layout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_dequantize_equals_the_pytorch_form(dtype, monkeypatch):
    """kernels.triton_nf4 (the GPU path of Nf4Layout.dequantize) gives the PyTorch form's
    values element for element: matrices of several blocks of 256 absmax values and one that
    ends inside such a block, stacked experts, an unquantised vector between them, a matrix
    that ends inside a program. Without a
    GPU it runs under the Triton interpreter, which rounds fp32 to bf16 by truncation, so bf16
    is compared on CUDA only."""
    pytest.importorskip("triton")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    if interpret and dtype == torch.bfloat16:
        pytest.skip("the interpreter truncates fp32 to bf16")
    device = "cpu" if interpret else "cuda"
    layout = Layout.build([("a.weight", (96, 256)), ("norm.weight", (256,)),
                           ("experts.w", (3, 64, 4160)), ("b.weight", (40, 80))])  # b: a last
    # program only partly inside the matrix (1,600 code bytes)
    q = Nf4Layout.build(layout, dtype)
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0)) * 0.05
    buf = q.quantize(flat, torch.zeros(q.nbytes, dtype=torch.uint8)).to(device)
    monkeypatch.setenv("SLIDEFORMER_TRITON", "0")
    ref = q.dequantize(buf, torch.empty(layout.numel, dtype=dtype, device=device))
    monkeypatch.delenv("SLIDEFORMER_TRITON")
    before = dispatch.LAUNCHES["triton_nf4_dequant"]
    got = q.dequantize(buf, torch.full((layout.numel,), float("nan"), dtype=dtype, device=device))
    assert dispatch.LAUNCHES["triton_nf4_dequant"] - before == 3  # one per matrix
    assert torch.equal(got, ref)
