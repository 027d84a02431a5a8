"""The fused Triton RMSNorm, RoPE and SwiGLU against the PyTorch reference in ``layers``.

Each kernel's output and gradients are compared with the reference maths evaluated in float64 on
the same inputs (the truth), beside the PyTorch path in the test's dtype: in fp32 both must be
close to the truth; in bf16 the kernel must be within a bf16 tolerance and no further from the
truth than the PyTorch bf16 path is (plus one ulp of slack). A launch counter makes a silent
fall-back to PyTorch fail. The ``gpu`` tests run on CUDA; without a GPU they run on CPU tensors
under the Triton interpreter (fp32 only: it has no bf16 arithmetic), which checks the kernels'
logic but not their compilation:

    TRITON_INTERPRET=1 python -m pytest tests/engine/kernels/test_fused_layer_ops.py -m gpu
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from slideformer.engine.kernels import dispatch
from slideformer.engine.models import layers
from slideformer.engine.models.spec import spec_from_config

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
# Largest error as a fraction of the largest |truth|: fp32 rounding (sums of up to 8192
# terms), and for bf16 a few ulps (2**-8 each) of outputs that the reference rounds 2-3 times.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
SLACK = {torch.float32: TOL[torch.float32], torch.bfloat16: 2.0 ** -8}
"""How much further from the truth than the PyTorch path the kernel may be: in fp32 the path
is the truth's own maths, so only the tolerance; in bf16 one ulp."""


def gpu(test):
    """Marks a test that runs a kernel: on CUDA, or on CPU under the interpreter."""
    skip = pytest.mark.skipif(not HAVE_TRITON or not (INTERPRET or torch.cuda.is_available()),
                              reason="needs triton and a CUDA GPU, or TRITON_INTERPRET=1")
    return pytest.mark.gpu(skip(test))


@pytest.fixture
def launches(monkeypatch):
    """A fresh launch counter; the ops run their fused path (SLIDEFORMER_TRITON unset)."""
    counter = Counter()
    monkeypatch.setattr(dispatch, "LAUNCHES", counter)
    monkeypatch.delenv(dispatch.ENV, raising=False)
    return counter


def max_err(a: torch.Tensor, truth: torch.Tensor) -> float:
    return (a.double() - truth).abs().max().item()


def check(got, ref, truth, dtype, what: str) -> None:
    """``got`` (kernel) near the float64 ``truth``, and no further than ``ref`` (PyTorch) + 1 ulp."""
    for g, r, t, name in zip(got, ref, truth, what.split()):
        top = max(t.abs().max().item(), 1e-2)  # a floor for outputs that cancel to ~0 (N = 1)
        e_got, e_ref = max_err(g, t), max_err(r, t)
        assert e_got <= TOL[dtype] * top, f"{name}: error {e_got:.3g} vs max |truth| {top:.3g}"
        assert e_got <= e_ref + SLACK[dtype] * top, (
            f"{name}: kernel error {e_got:.3g} above the PyTorch path's {e_ref:.3g}")


def grads(fn, inputs, seed=1):
    """fn(*inputs) and its gradients w.r.t. every input for a fixed random dL/dy."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = fn(*leaves)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.device, y.dtype)
    return [y, *torch.autograd.grad(y, leaves, gy)]


def reference(fn, inputs, seed=1):
    """The PyTorch path (SLIDEFORMER_TRITON=0) and its float64 truth."""
    os.environ[dispatch.ENV] = "0"
    try:
        ref = grads(fn, inputs, seed)
        truth = grads(fn, [t.double() for t in inputs], seed)
    finally:
        del os.environ[dispatch.ENV]
    return ref, truth


# ---- RMSNorm ------------------------------------------------------------------------------------
def norm_inputs(shape, dtype, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    w = 1 + 0.3 * torch.randn(shape[-1], generator=g)
    return x.to(DEVICE, dtype), w.to(DEVICE, w_dtype or dtype)


# one row, one column, odd widths, a row count off every block, Llama widths up to 8192
NORM_SHAPES = [(1, 1), (1, 3072), (7, 37), (3, 5, 4099), (2, 129, 3072), (65, 8192)]


# Gemma's norms (1 + w, Gemma 3; w in fp32, Gemma 4) scale in fp32 and round once: the fused
# kernel takes them too, over the hidden size and per head
KINDS = [(0.0, False, NORM_SHAPES), (1.0, False, [(7, 37), (3, 5, 4, 256), (2, 129, 5376)]),
         (0.0, True, [(7, 37), (3, 5, 4, 256), (2, 129, 5376)])]


@gpu
@dtypes
@pytest.mark.parametrize("offset,fp32,shape", [(o, f, s) for o, f, shapes in KINDS for s in shapes])
def test_rms_norm_matches_reference(shape, offset, fp32, dtype, launches):
    x, w = norm_inputs(shape, dtype)
    w = (w.float() - offset).to(dtype)  # Gemma 3 stores its weights as w - 1
    fn = lambda a, b: layers.rms_norm(a, b, 1e-5, None, offset, fp32)  # noqa: E731
    got = grads(fn, [x, w])
    assert launches["rms_norm_fwd"] == 1 and launches["rms_norm_bwd"] == 1
    assert got[0].dtype == dtype and got[2].dtype == dtype
    ref, truth = reference(fn, [x, w])
    check(got, ref, truth, dtype, "y dx dw")


@gpu
@dtypes
def test_rms_norm_of_a_transposed_view(dtype, launches):
    # the Qwen3 q/k norms see (B, heads, T, hd) views of the projection's output
    B, T, nh, hd = 2, 33, 3, 128
    x, w = norm_inputs((B, T, nh * hd), dtype)
    fn = lambda a, b: layers.rms_norm(a.view(B, T, nh, hd).transpose(1, 2), b[:hd], 1e-6)  # noqa: E731
    got = grads(fn, [x, w])
    assert launches["rms_norm_fwd"] == 1
    ref, truth = reference(fn, [x, w])
    check(got, ref, truth, dtype, "y dx dw")


@gpu
@dtypes
def test_unit_norm_matches_reference(dtype, launches):
    """Gemma 4's value norm (no weight) through the fused kernel."""
    x, _ = norm_inputs((3, 7, 4, 256), dtype)
    fn = lambda a: layers.unit_rms(a, 1e-6)  # noqa: E731
    got = grads(fn, [x])
    assert launches["rms_norm_fwd"] == 1 and launches["rms_norm_bwd"] == 1
    ref, truth = reference(fn, [x])
    check(got, ref, truth, dtype, "y dx")


@gpu
def test_rms_norm_fp32_residual_to_bf16_output(launches):
    """An fp32 residual stream normed into the compute dtype (the precision option's case)."""
    if INTERPRET:
        pytest.skip("the interpreter has no bf16 arithmetic")
    x, w = norm_inputs((5, 300, 3072), torch.float32, torch.bfloat16)
    got = grads(lambda a, b: dispatch.rms_norm(a, b, 1e-5, torch.bfloat16), [x, w])
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert got[2].dtype == torch.bfloat16
    _, truth = reference(lambda a, b: layers.rms_norm(a, b, 1e-5), [x, w])
    for g, t, name in zip(got, truth, ("y", "dx", "dw")):
        err, top = max_err(g, t), t.abs().max().item()
        assert err <= 1e-2 * top, f"{name}: error {err:.3g} vs max |truth| {top:.3g}"


@gpu
def test_bf16_qk_to_fp32_norm_and_rope(launches):
    """bf16 q/k normed and rotated in fp32 with fp32 tables (the precision option's attention
    inputs): both ops scale in fp32 and round once, into fp32."""
    if INTERPRET:
        pytest.skip("the interpreter has no bf16 arithmetic")
    B, T, nh, hd = 2, 77, 4, 128
    x, w = norm_inputs((B, T, nh * hd), torch.bfloat16)
    cos, sin = layers.rope_tables(llama_spec(hd, 1, 1, hd, rope_scaling=LLAMA3),
                                  torch.arange(T, device=DEVICE).expand(B, T), torch.float32)

    def fused(a, b):
        q = dispatch.rms_norm(a.view(B, T, nh, hd).transpose(1, 2), b[:hd], 1e-6, torch.float32)
        return dispatch.apply_rope(q, cos, sin, torch.float32)
    got = grads(fused, [x, w])
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    assert launches["rms_norm_fwd"] == 1 and launches["rope_fwd"] == 1

    def plain(a, b):
        q = layers.rms_norm(a.view(B, T, nh, hd).transpose(1, 2), b[:hd], 1e-6)
        return layers.apply_rope(q, cos.to(a.dtype), sin.to(a.dtype))
    _, truth = reference(plain, [x, w])
    for g, t, name in zip(got, truth, ("y", "dx", "dw")):
        err, top = max_err(g, t), t.abs().max().item()
        assert err <= 1e-2 * top, f"{name}: error {err:.3g} vs max |truth| {top:.3g}"


@gpu
def test_rms_norm_without_weight_grad(launches):
    x, w = norm_inputs((4, 64), torch.float32)
    xl = x.clone().requires_grad_()
    y = layers.rms_norm(xl, w, 1e-5)  # a frozen weight (LoRA's base layers)
    (dx,) = torch.autograd.grad(y, [xl], torch.ones_like(y))
    os.environ[dispatch.ENV] = "0"
    try:
        xr = x.clone().requires_grad_()
        (dx_ref,) = torch.autograd.grad(layers.rms_norm(xr, w, 1e-5), [xr], torch.ones_like(y))
    finally:
        del os.environ[dispatch.ENV]
    assert launches["rms_norm_bwd"] == 1
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)


# ---- RoPE ---------------------------------------------------------------------------------------
def llama_spec(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int = 8,
               rope_scaling=None):
    """A one-layer Llama spec of the given attention shape."""
    cfg = dict(model_type="llama", vocab_size=32, hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
               head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, torch_dtype="bfloat16")
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    return spec_from_config(cfg)


LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# (B, heads, T, hd): GQA-sized k, odd head counts and lengths, a head_dim off a power of two
ROPE_SHAPES = [(1, 1, 1, 2), (2, 3, 17, 10), (3, 8, 100, 128), (1, 24, 257, 128), (2, 5, 9, 80)]


def rope_inputs(shape, dtype, packed: bool):
    B, heads, T, hd = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, heads, hd, generator=g).to(DEVICE, dtype).transpose(1, 2)  # as q, k
    pos = torch.arange(T).expand(B, T)
    if packed:  # positions restart at document boundaries
        pos = pos % max(T // 3, 1)
    cos, sin = layers.rope_tables(llama_spec(hd, 1, 1, hd, rope_scaling=LLAMA3), pos.to(DEVICE), dtype)
    return x, cos, sin


@gpu
@dtypes
@pytest.mark.parametrize("shape", ROPE_SHAPES)
@pytest.mark.parametrize("packed", [False, True])
def test_rope_matches_reference(shape, dtype, packed, launches):
    x, cos, sin = rope_inputs(shape, dtype, packed)
    fn = lambda a: layers.apply_rope(a, cos, sin)  # noqa: E731
    got = grads(fn, [x])
    assert launches["rope_fwd"] == 1 and launches["rope_bwd"] == 1
    assert got[0].stride() == x.stride(), "the output keeps the input's layout"
    ref, truth = reference(lambda a: layers.apply_rope(a, cos.to(a.dtype), sin.to(a.dtype)), [x])
    check(got, ref, truth, dtype, "y dx")


@gpu
def test_rope_broadcasts_one_table_over_the_batch(launches):
    x, cos, sin = rope_inputs((3, 4, 20, 64), torch.float32, False)
    y = layers.apply_rope(x, cos[:1], sin[:1])
    os.environ[dispatch.ENV] = "0"
    try:
        ref = layers.apply_rope(x, cos[:1], sin[:1])
    finally:
        del os.environ[dispatch.ENV]
    assert launches["rope_fwd"] == 1
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


# ---- SwiGLU -------------------------------------------------------------------------------------
@gpu
@dtypes
@pytest.mark.parametrize("shape", [(1,), (1, 1, 8192), (3, 7, 33), (2, 129, 8192)])
def test_swiglu_matches_reference(shape, dtype, launches):
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(*shape, generator=g) * 4).to(DEVICE, dtype)  # silu's curved part and tails
    up = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    got = grads(layers.swiglu, [gate, up])
    assert launches["swiglu_fwd"] == 1 and launches["swiglu_bwd"] == 1
    ref, truth = reference(layers.swiglu, [gate, up])
    check(got, ref, truth, dtype, "y dgate dup")


# ---- dispatch -----------------------------------------------------------------------------------
@gpu
@pytest.mark.skipif(INTERPRET, reason="the interpreter runs on CPU tensors: nothing to dispatch")
def test_cuda_layer_runs_every_fused_op_and_the_switch_turns_them_off(launches, monkeypatch):
    """A whole decoder layer on CUDA: forward and backward take each fused op; with
    SLIDEFORMER_TRITON=0 none, and the two agree within bf16 rounding."""
    spec = llama_spec(256, 4, 2, 64, inter=688)
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(spec.params_per_layer, generator=g) * 0.05).to("cuda", torch.bfloat16)
    x = torch.randn(2, 64, 256, generator=g).to("cuda", torch.bfloat16)
    rope = layers.rope_tables(spec, torch.arange(64, device="cuda").expand(2, 64), torch.bfloat16)

    def run():
        p = {k: v.detach().requires_grad_() for k, v in spec.layer_layout.views(flat).items()}
        return grads(lambda xi: layers.decoder_layer(spec, p, xi, rope), [x])
    fused = run()
    assert launches == Counter(rms_norm_fwd=2, rms_norm_bwd=2, rope_fwd=2, rope_bwd=2,
                               swiglu_fwd=1, swiglu_bwd=1)
    monkeypatch.setenv(dispatch.ENV, "0")
    plain = run()
    assert sum(launches.values()) == 10, "SLIDEFORMER_TRITON=0 must keep every op on PyTorch"
    for a, b, name in zip(fused, plain, ("y", "dx")):
        err, top = max_err(a, b.double()), b.abs().max().item()
        assert err <= 3e-2 * top, f"{name}: fused vs PyTorch {err:.3g} (max |ref| {top:.3g})"


def test_cpu_tensors_take_the_pytorch_path(monkeypatch):
    monkeypatch.setattr(dispatch, "LAUNCHES", Counter())
    x = torch.randn(2, 3, 8)
    layers.rms_norm(x, torch.ones(8), 1e-5)
    layers.swiglu(x, x)
    assert not dispatch.use_triton(x) and not dispatch.LAUNCHES
