"""train.precision = "fp8" (slideformer.engine.kernels.fp8): the row-wise FP8 product against its
PyTorch reference, where the layers take it, training through the window (the CPU emulating
the FP8 matmuls), and the refusals."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.kernels import fp8


def _cpu_scaled_mm() -> bool:
    try:
        fp8.matmul(torch.ones(2, 16).bfloat16(), torch.ones(16, 16).bfloat16(), torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


pytestmark = pytest.mark.skipif(not _cpu_scaled_mm(),
                                reason="this torch has no CPU torch._scaled_mm to emulate FP8")


def operands(seed=0, rows=(3, 10), k=64, n=80):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, k, generator=g).bfloat16()
    x[0, 0] *= 50  # an outlier token: its own row scale
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    return x, w, torch.randn(*rows, n, generator=g).bfloat16()


def test_product_and_input_gradient_equal_the_rowwise_reference():
    """The forward y = x W^T and dL/dx = dL/dy W are the e4m3 row-wise products exactly as
    written out in PyTorch; dL/dW and the bias's gradient are the bf16 ones; the forward sits
    within FP8's rounding of the bf16 product."""
    x, w, gy = operands()
    b = torch.randn(w.shape[0]).bfloat16()
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8.linear(xx, ww, bb)
    assert torch.equal(y, fp8.reference(x, w) + b)
    y.backward(gy)
    assert torch.equal(xx.grad, fp8.reference(gy.reshape(-1, w.shape[0]), w.t()).view(x.shape))
    assert torch.equal(ww.grad, gy.reshape(-1, w.shape[0]).t().mm(x.reshape(-1, w.shape[1])))
    assert torch.equal(bb.grad, gy.reshape(-1, w.shape[0]).sum(0))
    exact = x.float() @ w.float().t()
    rel = ((y - b).float() - exact).norm() / exact.norm()
    assert 1e-3 < rel < 0.06, rel  # e4m3 keeps 3 mantissa bits: a few % per product


def test_weight_gradient_goes_into_the_fp32_buffer():
    x, w, gy = operands(1)
    dest = torch.zeros(w.shape)
    xx = x.clone().requires_grad_()
    fp8.linear(xx, w, None, dest).backward(gy)
    ref = (gy.reshape(-1, w.shape[0]).t() @ x.reshape(-1, w.shape[1])).float()
    torch.testing.assert_close(dest, ref, rtol=1e-2, atol=1e-3)  # added in fp32, not rounded


def test_layers_take_fp8_only_when_asked_and_eligible(monkeypatch):
    """models.layers.linear: FP8 inside ``fp8.enabled()`` for the feed-forward's 16-bit
    projections only; the attention's projections, fp32 operands and calls outside stay as they
    were."""
    from slideformer.engine.models import layers
    x, w, _ = operands(2)
    p = {"mlp.up_proj.weight": w, "self_attn.q_proj.weight": w}
    calls = []
    real = fp8.linear
    monkeypatch.setattr(fp8, "linear", lambda *a: calls.append(1) or real(*a))
    plain = layers.linear(p, "mlp.up_proj", x)
    with fp8.enabled():
        quant = layers.linear(p, "mlp.up_proj", x)
        attn = layers.linear(p, "self_attn.q_proj", x)
        full = layers.linear({"mlp.up_proj.weight": w.float()}, "mlp.up_proj", x.float())
    assert len(calls) == 1
    assert torch.equal(attn, plain)
    assert torch.equal(quant, fp8.reference(x, w)) and not torch.equal(quant, plain)
    assert torch.equal(full, x.float() @ w.float().t())
    assert not fp8.active()


def test_training_in_fp8_stays_near_bf16(tmp_path):
    """Twelve steps of a tiny Llama through the window (K=2 of 4 layers, clipping on) with FP8
    projections: the loss falls as in bf16, and the final weights sit closer to the bf16 run's
    than the distance those runs moved (measured: benchmarks/precision.py)."""
    from tests.engine.runtime.test_precision import engine_run, family_setup
    spec, d, steps, w0 = family_setup("llama", 12, tmp_path)
    bf16 = engine_run(spec, d, steps, torch.bfloat16)
    f8 = engine_run(spec, d, steps, torch.bfloat16, fp8=True)
    assert f8[0][-1] < f8[0][0] - 0.2 and bf16[0][-1] < bf16[0][0] - 0.2
    assert not torch.equal(f8[1], bf16[1])  # the FP8 path ran
    moved = (bf16[1] - w0).norm()
    assert (f8[1] - bf16[1]).norm() < 0.3 * moved


def test_fp8_is_refused_where_it_cannot_run():
    from slideformer.engine.devices import check_fp8, residual_dtype_name
    assert residual_dtype_name("fp8", "bfloat16") == "bfloat16"
    with pytest.raises(UserError, match="FP8 tensor cores.*on the cpu"):
        check_fp8("bfloat16", "cpu")
    with pytest.raises(UserError, match="compute_dtype is float32"):
        check_fp8("float32", "cuda")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(UserError, match="has no FP8 tensor cores"):
            check_fp8("bfloat16", "cuda")


def test_a_cpu_run_with_fp8_stops_before_training(tiny_model_factory, tmp_path):
    """The trainer refuses it in set-up with the message, nothing trained."""
    from slideformer.engine.config import RunConfig, override
    from slideformer.engine.train.trainer import Trainer
    cfg = override(RunConfig(), {"model.path": str(tiny_model_factory("llama")),
                                 "output.run_dir": str(tmp_path / "run"), "train.device": "cpu",
                                 "train.compute_dtype": "bfloat16", "train.precision": "fp8"})
    trainer = Trainer(cfg)
    try:
        with pytest.raises(UserError, match="train.precision"):
            trainer.setup(data=(None, None))
    finally:
        trainer.cleanup()


def test_the_kernel_gets_a_row_major_and_a_column_major_operand(monkeypatch):
    """The GPU's _scaled_mm takes A row-major and B column-major (the CPU emulation takes any
    layout): so do the forward and dL/dx, whose weight operand is a transposed view."""
    seen = []
    real = torch._scaled_mm

    def checking(a, b, **kw):
        seen.append((a.stride(1) == 1, b.stride(0) == 1))
        return real(a, b, **kw)
    monkeypatch.setattr(torch, "_scaled_mm", checking)
    x, w, gy = operands(4)
    xx = x.clone().requires_grad_()
    fp8.linear(xx, w).backward(gy)
    assert seen == [(True, True), (True, True)]  # the forward, then dL/dx


@pytest.mark.parametrize("nf4", [False, True])
def test_lora_and_qlora_train_with_fp8_projections(tiny_model_factory, nf4):
    """A frozen bf16 (or NF4, dequantised to bf16) base: its MLP projections run in FP8, the
    adapters' own products in bf16; the loss falls as with bf16, and the adapters land within
    0.6 of the way the bf16 run moved them from the bf16 run's (8 Adam steps at lr 2e-2 on one
    batch, where Adam's normalised steps magnify small gradient differences)."""
    from slideformer.engine.config import LoraConfig, OptimConfig
    from slideformer.engine.models.lora import for_model, lora_spec
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.tiny import TinyShape
    from slideformer.engine.runtime.backend import CpuBackend
    from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
    from slideformer.engine.runtime.host_state import AdamHyper
    from slideformer.engine.runtime.lora import init_adapters
    from slideformer.engine.train.state import build_frozen_state, load_weights
    from tests.engine.runtime.test_sliding_equivalence import make_batches
    d = tiny_model_factory("llama", TinyShape(hidden=64, heads=4, kv_heads=2, intermediate=128))
    spec = load_spec(d)
    lora = for_model(lora_spec(LoraConfig(rank=4, alpha=8.0)), spec)
    optim = OptimConfig(lr=2e-2)
    batches = make_batches(spec, 2, B=2, T=32, seed=4)[:1] * 8  # one batch: the loss must fall

    def adapters(host):
        return torch.cat([host[f"lora{i}"].master() for i in range(spec.num_layers)])

    def run(use_fp8):
        host = build_frozen_state(spec, CpuBackend(), torch.bfloat16, torch.float32, lora, nf4=nf4)
        load_weights(host, spec, d)
        init_adapters({k: v for k, v in host.items() if k.startswith("lora")}, 0)
        start.append(adapters(host))
        ex = SlidingExecutor(spec, CpuBackend(), host, ExecShape(micro_batch=2, seq_len=32,
                                                                 n_micro=2, slots=2),
                             torch.bfloat16, lora=lora, fp8=use_fp8)
        losses = [ex.train_step(mbs, lambda coef, k=k: AdamHyper(optim.lr, 0.9, 0.999, 1e-8, 0.0,
                                                                 k, coef), 1.0).loss
                  for k, mbs in enumerate(batches, start=1)]
        ex.close()
        return losses, adapters(host)
    start: list = []
    (l8, a8), (lb, ab) = run(True), run(False)
    assert torch.equal(start[0], start[1])
    assert l8[-1] < l8[0] - 0.1 and lb[-1] < lb[0] - 0.1
    assert not torch.equal(a8, ab)
    moved = (ab - start[0]).norm()
    print(f"fp8 against bf16: {(a8 - ab).norm() / moved:.3f} of the bf16 run's move")
    assert (a8 - ab).norm() < 0.6 * moved  # measured 0.43 (bf16 base) and 0.44 (NF4)


def test_fp8_is_refused_for_a_model_of_experts_only(tiny_model_factory):
    """FP8 runs only the dense MLP's projections: a model whose every feed-forward is a mixture
    of experts would run bf16 all the same, so the setting is refused rather than ignored;
    Gemma 4's MoE layers keep their dense MLP beside the experts, and take it."""
    from slideformer.engine.devices import check_fp8
    from slideformer.engine.models.spec import load_spec
    moe = load_spec(tiny_model_factory("qwen3_moe"))
    assert moe.dense_mlp_width == 0
    with pytest.raises(UserError, match="no dense feed-forward"):
        check_fp8("bfloat16", "cuda", moe)
    g4 = load_spec(tiny_model_factory("gemma4_text", extra_config={"enable_moe_block": True}))
    assert g4.dense_mlp_width == g4.intermediate_size
    with pytest.raises(UserError, match="FP8 tensor cores.*on the cpu"):  # the next check
        check_fp8("bfloat16", "cpu", g4)
