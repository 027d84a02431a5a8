"""The Triton cross-entropy kernel against the PyTorch path and the autograd reference.

The ``gpu`` tests run on CUDA; without a GPU they run on CPU tensors under the Triton
interpreter (slow: numpy per program), which checks the kernel's logic but not its compilation:

    TRITON_INTERPRET=1 python -m pytest tests/engine/runtime/test_triton_ce.py -m gpu
"""
from __future__ import annotations

import os

import pytest
import torch

from slideformer.engine.kernels import dispatch, linear_ce
from slideformer.engine.kernels.linear_ce import (_chunk_grads, _chunk_grads_torch, linear_ce_fwd_bwd,
                                      linear_ce_loss, reference_linear_cross_entropy)

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def gpu(test):
    """Marks a test that runs the kernel: on CUDA, or on CPU under the interpreter."""
    skip = pytest.mark.skipif(not HAVE_TRITON or not (INTERPRET or torch.cuda.is_available()),
                              reason="needs triton and a CUDA GPU, or TRITON_INTERPRET=1")
    return pytest.mark.gpu(skip(test))


# (n tokens, V vocab, H hidden): n = 1 and odd n, V = 1, V off the kernel's block size, and the
# Llama-3 vocabulary for a moderate n.
CASES = [(1, 1, 64), (1, 127, 3072), (7, 127, 64), (7, 32000, 3072), (1000, 127, 3072),
         (1000, 32000, 64), (300, 128256, 64)]
DTYPES = [torch.float32, torch.bfloat16]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
SCALE = 0.37
# The kernel and the PyTorch path see the same logits: they differ by fp32 rounding of the
# log-sum-exp, then by one rounding of dz to the dtype (2**-8 relative in bf16).
SAME_Z_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-5)}
# Gradients, as a fraction of the largest reference value: against the PyTorch path (dz rounded
# once more or less in bf16) and against autograd on the full logits. Measured on CPU: 5e-6 fp32
# (cancellation in dz @ W, sum dz = 0), 8.6e-3 bf16 (2 ulp: dz, then dz @ W).
GRAD_TOL = {torch.float32: 5e-5, torch.bfloat16: 2e-2}


def make_inputs(n, V, H, dtype, device, seed=0, ignore=0.25, mag=1.0):
    """h (n, H), w (V, H) with logits ~ N(0, mag^2), labels with ignored rows, 0 and V-1."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g) * mag
    w = torch.randn(V, H, generator=g) / H ** 0.5
    y = torch.randint(0, V, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignore] = -100
    y[0], y[-1] = V - 1, 0  # one row when n = 1: then the label is 0
    return h.to(device, dtype), w.to(device, dtype), y.to(device)


def assert_close_to_ref(a, b, tol, what):
    err, top = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
    assert err <= tol * max(top, 1e-30), f"{what}: max error {err:.3g} vs max |ref| {top:.3g}"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launches of the Triton kernel, so a silent fall-back to PyTorch fails a test."""
    from slideformer.engine.kernels import triton_ce
    calls = {"grad": 0, "loss": 0}

    def counting(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper
    monkeypatch.setattr(triton_ce, "ce_grad_rows_", counting("grad", triton_ce.ce_grad_rows_))
    monkeypatch.setattr(triton_ce, "ce_loss_rows", counting("loss", triton_ce.ce_loss_rows))
    return calls


@gpu
@dtypes
@pytest.mark.parametrize("n,V,H", CASES)
@pytest.mark.parametrize("mag", [1.0, 3000.0])
def test_chunk_matches_torch_path(n, V, H, dtype, mag, kernel_calls):
    # mag 3000: logits of ~1e4 (exp overflows fp32 without the running max)
    h, w, y = make_inputs(n, V, H, dtype, DEVICE, mag=mag)
    loss, dz = _chunk_grads(h, w, y, SCALE, use_triton=True)
    ref_loss, ref_dz = _chunk_grads_torch(h, w, y, SCALE)
    assert kernel_calls["grad"] == 1
    assert dz.dtype == dtype and dz.shape == (n, V)
    assert torch.isfinite(loss) and torch.isfinite(dz.float()).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dz.float(), ref_dz.float(), **SAME_Z_TOL[dtype])
    assert (dz[y == -100] == 0).all()


@gpu
@dtypes
@pytest.mark.parametrize("n,V,H", CASES)
def test_fwd_bwd_matches_autograd(n, V, H, dtype, kernel_calls):
    h, w, y = make_inputs(n, V, H, dtype, DEVICE, seed=1)
    chunk = n // 3 + 1  # a short last chunk
    gw = torch.zeros(V, H, dtype=torch.float32, device=DEVICE)
    loss, gh = linear_ce_fwd_bwd(h, w, y, SCALE, chunk, gw, use_triton=True)
    assert kernel_calls["grad"] == -(-n // chunk)

    gw_t = torch.zeros_like(gw)
    loss_t, gh_t = linear_ce_fwd_bwd(h, w, y, SCALE, chunk, gw_t, use_triton=False)
    torch.testing.assert_close(loss, loss_t, rtol=1e-5, atol=1e-5)
    assert_close_to_ref(gh, gh_t, GRAD_TOL[dtype], "dL/dh vs PyTorch path")
    assert_close_to_ref(gw, gw_t, GRAD_TOL[dtype], "dL/dW vs PyTorch path")

    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference_linear_cross_entropy(hr, wr, y, SCALE)
    ref.backward()
    torch.testing.assert_close(loss, ref.float(), rtol=1e-5 if dtype == torch.float32 else 2e-3,
                               atol=1e-5)
    assert_close_to_ref(gh, hr.grad, GRAD_TOL[dtype], "dL/dh vs autograd")
    assert_close_to_ref(gw, wr.grad, GRAD_TOL[dtype], "dL/dW vs autograd")


@gpu
@dtypes
def test_all_rows_ignored(dtype, kernel_calls):
    h, w, y = make_inputs(5, 300, 64, dtype, DEVICE)
    y[:] = -100
    gw = torch.zeros(300, 64, device=DEVICE)
    loss, gh = linear_ce_fwd_bwd(h, w, y, SCALE, 2, gw, use_triton=True)
    assert kernel_calls["grad"] == 3
    assert loss.item() == 0 and (gh == 0).all() and (gw == 0).all()
    assert linear_ce_loss(h, w, y, 2, use_triton=True).item() == 0


@gpu
def test_label_out_of_range_gives_nan_loss():
    # the kernel must not read past the row; the PyTorch path raises instead
    h, w, y = make_inputs(3, 130, 16, torch.float32, DEVICE)
    y[1] = 130
    assert linear_ce_loss(h, w, y, 4, use_triton=True).isnan()


@gpu
@dtypes
@pytest.mark.parametrize("n,V,H", [(1, 1, 64), (7, 127, 64), (1000, 32000, 64)])
def test_eval_loss_matches_reference(n, V, H, dtype, kernel_calls):
    h, w, y = make_inputs(n, V, H, dtype, DEVICE, seed=2)
    loss = linear_ce_loss(h, w, y, n // 2 + 1, use_triton=True)
    assert kernel_calls["loss"] == (1 if n == 1 else 2)
    torch.testing.assert_close(loss, linear_ce_loss(h, w, y, n // 2 + 1, use_triton=False),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, reference_linear_cross_entropy(h, w, y).float(),
                               rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)


@gpu
@pytest.mark.skipif(INTERPRET, reason="the interpreter runs on CPU tensors: nothing to dispatch")
def test_cuda_dispatches_to_triton(kernel_calls, monkeypatch):
    h, w, y = make_inputs(10, 500, 64, torch.bfloat16, "cuda")
    gw = torch.zeros(500, 64, device="cuda")
    monkeypatch.delenv("SLIDEFORMER_TRITON", raising=False)
    linear_ce_fwd_bwd(h, w, y, 1.0, 4, gw)
    linear_ce_loss(h, w, y, 4)
    assert kernel_calls == {"grad": 3, "loss": 3}
    monkeypatch.setenv("SLIDEFORMER_TRITON", "0")
    linear_ce_fwd_bwd(h, w, y, 1.0, 4, gw)
    linear_ce_loss(h, w, y, 4)
    assert kernel_calls == {"grad": 3, "loss": 3}


# ---- CPU: runs everywhere, with or without triton ------------------------------------------------
def test_cpu_uses_pytorch_path():
    h, w, y = make_inputs(9, 130, 16, torch.float32, "cpu")
    assert not linear_ce._use_triton(h, None)
    gw, gw_t = torch.zeros(130, 16), torch.zeros(130, 16)
    loss, gh = linear_ce_fwd_bwd(h, w, y, SCALE, 4, gw)
    loss_t, gh_t = linear_ce_fwd_bwd(h, w, y, SCALE, 4, gw_t, use_triton=False)
    assert torch.equal(loss, loss_t) and torch.equal(gh, gh_t) and torch.equal(gw, gw_t)
    assert torch.equal(linear_ce_loss(h, w, y, 4), linear_ce_loss(h, w, y, 4, use_triton=False))

    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference_linear_cross_entropy(hr, wr, y, SCALE)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert_close_to_ref(gh, hr.grad, 1e-5, "dL/dh")
    assert_close_to_ref(gw, wr.grad, 1e-5, "dL/dW")


@pytest.mark.skipif(HAVE_TRITON, reason="triton is installed")
def test_forcing_triton_without_it_says_how_to_fix():
    h, w, y = make_inputs(2, 8, 4, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="pip install triton"):
        linear_ce_loss(h, w, y, 4, use_triton=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_head_gradient_accumulates_in_fp32_on_cuda():
    """dL/dW of the head: on CUDA one matmul adds dz^T h to the fp32 buffer (fp32_accumulate);
    it must equal the fp32 product to fp32 accumulation error, be closer to it than the
    row-block loop that rounds each block's product to bf16, and add to what was there."""
    assert dispatch.fp32_accumulate("cuda")
    g = torch.Generator().manual_seed(3)
    n, V, H = 1000, 20000, 256
    dz = (torch.randn(n, V, generator=g) * 1e-2).to("cuda", torch.bfloat16)
    h = torch.randn(n, H, generator=g).to("cuda", torch.bfloat16)
    before = torch.randn(V, H, generator=g).cuda()
    exact = before.double() + dz.double().t() @ h.double()
    fused = before.clone()
    linear_ce._add_outer(fused, dz, h)
    loop = before.clone()
    for r in range(0, V, linear_ce.GW_ROWS):  # the path elsewhere (CPU, older torch)
        loop[r:r + linear_ce.GW_ROWS] += (dz[:, r:r + linear_ce.GW_ROWS].t() @ h).float()
    err_fused = float((fused.double() - exact).abs().max())
    err_loop = float((loop.double() - exact).abs().max())
    assert err_fused <= 1e-5 * float(exact.abs().max())
    assert err_fused < err_loop
