"""Qwen3.5's layers on flat parameter views (models.deltanet) against transformers' modules on
the same weights, forward and gradients in fp32 on the CPU; the chunked delta rule against the
token-by-token one; packed documents against each document alone; prefill + decode steps
against one forward. GPU tests: fla's kernel and the bf16 layers against the references."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from slideformer.engine.models import deltanet as dn
from slideformer.engine.models.lora import LoraForward, LoraSpec
from slideformer.engine.models.families.base import DeltaNetShape
from slideformer.engine.models.spec import Layout, spec_from_config

q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
from transformers import Qwen3_5TextConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = 1e-4


def config(**kw) -> Qwen3_5TextConfig:
    """A tiny Qwen3.5: 2 key / 4 value heads in the DeltaNet, 4 query / 2 KV heads of 16 in
    the attention, RoPE on the first quarter of each head."""
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                vocab_size=128, rms_norm_eps=1e-6)
    return Qwen3_5TextConfig(**{**base, **kw})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|, |b| taken as at least 0.1: some gradients are exactly 0 (k_proj's at
    T = 1, where one key's softmax is 1 whatever its score) and ours are then roundoff."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(0.1)).item()


def randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn afresh (norm weights away from their init, A_log as transformers
    draws it), so no term of the maths hides behind a 0 or a 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.named_parameters():
            if name.endswith("A_log"):
                t.copy_(torch.empty(t.shape).uniform_(0.01, 16, generator=g).log())
            elif t.dim() == 1:
                t.copy_(torch.randn(t.shape, generator=g) * 0.3 + (0.5 if "bias" in name else 0))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    return module


def flat_views(module: torch.nn.Module):
    """The module's parameters copied into one flat leaf: (flat, layout, views by HF name)."""
    named = list(module.named_parameters())
    layout = Layout.build([(n, tuple(t.shape)) for n, t in named])
    flat = torch.cat([t.detach().reshape(-1) for _, t in named]).requires_grad_()
    return flat, layout, layout.views(flat)


def check_grads(module, layout, flat, x, x_ref):
    """x's gradient and every parameter's, ours (flat leaf) against transformers'."""
    assert rel(x.grad, x_ref.grad) < TOL
    ours = layout.views(flat.grad)
    for name, t in module.named_parameters():
        assert rel(ours[name], t.grad) < TOL, name


def causal_bias(T: int) -> torch.Tensor:
    """transformers' eager attention takes an additive mask: -inf above the diagonal."""
    return torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                         float("-inf"))[None, None]


# ---- the delta rule ---------------------------------------------------------------------------
def rule_inputs(B, T, Hk, Hv, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, Hv, dv, generator=g)
    decay = -F.softplus(torch.randn(B, T, Hv, generator=g) * 2)
    beta = torch.rand(B, T, Hv, generator=g)
    s0 = torch.randn(B, Hv, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("T", [1, 7, 64, 100, 130])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_rule_equals_the_recurrence(T, packed):
    """Output, final state and the gradients of all inputs, with an initial state, grouped
    values and (packed) document starts inside and across chunks."""
    raw = [t.requires_grad_() for t in rule_inputs(2, T, 2, 4, 8, 16)]
    starts = None
    if packed:
        starts = torch.zeros(2, T, dtype=torch.bool)
        starts[0, [i for i in (3, 64, 65, 90) if i < T]] = True
        starts[1, [i for i in (1, 50, 120) if i < T]] = True
    results = []
    for rule in (dn.chunked_rule, dn.recurrent_rule):
        o, S = rule(*dn.prepare(*raw[:5]), raw[5], starts)
        grads = torch.autograd.grad((o * o.detach().cos()).sum() + (S * S.detach().sin()).sum(),
                                    raw)
        results.append((o, S, grads))
    (o, S, grads), (o_ref, S_ref, grads_ref) = results
    assert rel(o, o_ref) < TOL and rel(S, S_ref) < TOL
    for gr, gr_ref in zip(grads, grads_ref):
        assert rel(gr, gr_ref) < TOL


def fla_contract(q, k, v, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's chunk_gated_delta_rule as its documentation states it, on the CPU: rows (B, T) or
    one row of sequences at ``cu_seqlens``, each from its own initial state (N, H, dk, dv)."""
    assert use_qk_l2norm_in_kernel and q.shape[2] == v.shape[2]
    bounds = ([(b, 0, q.shape[1]) for b in range(q.shape[0])] if cu_seqlens is None else
              [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    outs, finals = [], []
    for n, (b, s, e) in enumerate(bounds):
        s0 = (torch.zeros(1, v.shape[2], q.shape[-1], v.shape[-1]) if initial_state is None
              else initial_state[n:n + 1])
        o, S = dn.recurrent_rule(*dn.prepare(*(t[b:b + 1, s:e] for t in (q, k, v, g, beta))), s0)
        outs.append(o.transpose(1, 2))
        finals.append(S)
    o = torch.cat(outs, 1 if cu_seqlens is not None else 0).to(v.dtype)
    return o, (torch.cat(finals) if output_final_state else None)


@pytest.mark.parametrize("packed", [False, True])
def test_the_fla_path_keeps_fla_s_contract(monkeypatch, packed):
    """kernels.deltanet_gpu's call (heads repeated, rows cut at the document starts into
    cu_seqlens, each row's state into its first sequence and out of its last) through a CPU
    stand-in for fla that follows fla's documented contract, against the reference."""
    from slideformer.engine.kernels import deltanet_gpu
    raw = rule_inputs(2, 40, 2, 4, 8, 16, seed=3)
    starts = None
    if packed:
        starts = torch.zeros(2, 40, dtype=torch.bool)
        starts[0, [10, 11, 30]] = True
        starts[1, 39] = True
    o_ref, S_ref = dn.gated_delta_rule(*raw, starts)
    monkeypatch.setattr(dn, "fla_usable", lambda v: True)
    monkeypatch.setattr(deltanet_gpu, "_chunk_rule", lambda: fla_contract)
    o, S = dn.gated_delta_rule(*raw, starts)
    assert rel(o, o_ref) < TOL and rel(S, S_ref) < TOL


# ---- the gated DeltaNet against transformers ----------------------------------------------------
def deltanet_case(T: int, B: int = 2, seed: int = 0):
    cfg = config()
    hf = randomise(q35.Qwen3_5GatedDeltaNet(cfg, 0), seed)
    flat, layout, views = flat_views(hf)
    p = {"linear_attn." + n: v for n, v in views.items()}
    shape = spec_from_config(cfg.to_dict() | {"model_type": "qwen3_5_text"}).linear
    x = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(seed + 1))
    return hf, flat, layout, p, shape, x


def test_the_spec_reads_the_deltanet_sizes():
    spec = spec_from_config(config().to_dict() | {"model_type": "qwen3_5_text"})
    assert spec.linear == DeltaNetShape(2, 4, 8, 16, 4, 1e-6) and spec.linear.conv_dim == 96
    assert spec.rotary_dim == 4 and spec.layer_types == ("linear_attention", "full_attention")


@pytest.mark.parametrize("T", [1, 5, 64, 70, 130])
def test_gated_deltanet_matches_transformers(T):
    hf, flat, layout, p, shape, x = deltanet_case(T)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    y_ref = hf(x_ref)
    y = dn.gated_deltanet(shape, p, x)
    assert y.shape == y_ref.shape and rel(y, y_ref) < TOL
    gy = torch.randn_like(y)
    y.backward(gy)
    y_ref.backward(gy)
    check_grads(hf, layout, flat, x, x_ref)


def test_packed_documents_equal_each_document_alone():
    """Two rows of 78 tokens, documents of 5, 70, 3 and 50, 28 (chunk bounds inside them):
    outputs, dL/dx and the weights' gradients (summed over the documents)."""
    hf, flat, layout, p, shape, x = deltanet_case(78)
    lengths = [[5, 70, 3], [50, 28]]
    doc_ids = torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths])
    doc_ids[1] += 7  # ids need only change at the bounds
    x.requires_grad_()
    gy = torch.randn_like(x)
    y = dn.gated_deltanet(shape, p, x, doc_ids)
    (y * gy).sum().backward()
    packed_grads, flat.grad = flat.grad.clone(), None
    alone_x = torch.zeros_like(x)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            xd = x.detach()[b:b + 1, start:start + n].clone().requires_grad_()
            yd = dn.gated_deltanet(shape, p, xd)
            assert rel(y[b:b + 1, start:start + n], yd) < TOL
            (yd * gy[b:b + 1, start:start + n]).sum().backward()
            alone_x[b, start:start + n] = xd.grad[0]
            start += n
    assert rel(x.grad, alone_x) < TOL
    assert rel(packed_grads, flat.grad) < TOL


@pytest.mark.parametrize("prompt", [2, 67])
def test_prefill_then_decode_steps_equal_one_forward(prompt):
    """A prompt shorter than the convolution's reach and one past a chunk, then 5 one-token
    steps: outputs and the final state equal one forward over all the tokens."""
    _, _, _, p, shape, x = deltanet_case(prompt + 5)
    with torch.no_grad():
        y_all, (conv_all, rec_all) = dn.gated_deltanet(shape, p, x, state=dn.zero_state(shape, 
            2, x.dtype, x.device))
        y, state = dn.gated_deltanet(shape, p, x[:, :prompt],
                                     state=dn.zero_state(shape, 2, x.dtype, x.device))
        ys = [y]
        for t in range(prompt, prompt + 5):
            y, state = dn.gated_deltanet(shape, p, x[:, t:t + 1], state=state)
            ys.append(y)
    assert rel(torch.cat(ys, 1), y_all) < TOL
    assert state[0].shape == (2, shape.conv_dim, 3) and rel(state[0], conv_all) < TOL
    assert state[1].shape == (2, 4, 8, 16) and rel(state[1], rec_all) < TOL
    assert torch.equal(dn.gated_deltanet(shape, p, x), y_all)


def test_packed_prefill_state_is_the_last_documents():
    """With documents in the prompt, the state carries the last one alone: decoding on from it
    equals decoding on from that document's own prefill."""
    _, _, _, p, shape, x = deltanet_case(30, B=1)
    doc_ids = torch.tensor([[0] * 28 + [1] * 2])
    zero = dn.zero_state(shape, 1, x.dtype, x.device)
    with torch.no_grad():
        _, packed = dn.gated_deltanet(shape, p, x[:, :30], doc_ids, state=zero)
        _, alone = dn.gated_deltanet(shape, p, x[:, 28:30], state=zero)
        step = torch.randn(1, 1, 64)
        y_packed, _ = dn.gated_deltanet(shape, p, step, state=packed)
        y_alone, _ = dn.gated_deltanet(shape, p, step, state=alone)
    assert rel(packed[0], alone[0]) < TOL and rel(packed[1], alone[1]) < TOL
    assert rel(y_packed, y_alone) < TOL


def test_lora_on_the_deltanet_projections_equals_merged_weights():
    hf, flat, layout, p, shape, x = deltanet_case(20)
    g = torch.Generator().manual_seed(5)
    adapters, names = {}, ["in_proj_qkv", "in_proj_z", "out_proj"]
    for n in names:
        out, inp = p[f"linear_attn.{n}.weight"].shape
        adapters[f"linear_attn.{n}.lora_A.weight"] = torch.randn(2, inp, generator=g) * 0.1
        adapters[f"linear_attn.{n}.lora_B.weight"] = torch.randn(out, 2, generator=g) * 0.1
    lora = LoraForward(LoraSpec(2, 4.0, 0.0, ("q_proj",)), adapters, None)
    with torch.no_grad():
        for n in names:
            getattr(hf, n).weight += 2.0 * (adapters[f"linear_attn.{n}.lora_B.weight"]
                                            @ adapters[f"linear_attn.{n}.lora_A.weight"])
        assert rel(dn.gated_deltanet(shape, p, x, lora=lora), hf(x)) < TOL


# ---- gated attention ----------------------------------------------------------------------------
# ---- GPU: fla and bf16 ---------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla")


def _fla_refused() -> bool:
    from slideformer.engine.kernels.deltanet_gpu import fla_refused_on
    return torch.cuda.is_available() and fla_refused_on(torch.device("cuda"))


fla_runs = pytest.mark.skipif(_fla_refused(), reason="fla's backward refuses this GPU and "
                              "Triton (deltanet_gpu.fla_refused_on): the PyTorch rule runs")


@pytest.mark.gpu
@cuda
@fla
@fla_runs
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_rule_matches_the_reference(packed, with_state):
    """fla's kernel (bf16 on CUDA) against the chunked reference (fp32 on the CPU) on the same
    bf16 inputs: output, final state and every input's gradient."""
    from slideformer.engine.kernels.dispatch import LAUNCHES
    B, T = 2, 300
    raw = [t.to(torch.bfloat16) for t in rule_inputs(B, T, 2, 4, 64, 64)]
    raw[3] = raw[3].float()  # g in fp32, as gated_deltanet makes it
    starts = None
    if packed:
        starts = torch.zeros(B, T, dtype=torch.bool)
        starts[0, [5, 100, 101, 200]] = True
        starts[1, [64, 250]] = True
    results = []
    for dev in ("cuda", "cpu"):
        ins = [t.to(dev).requires_grad_() for t in raw]
        s0 = ins[5].float() if with_state else None
        before = LAUNCHES["fla_gated_delta_rule"]
        o, S = dn.gated_delta_rule(*ins[:5], s0, None if starts is None else starts.to(dev))
        assert (LAUNCHES["fla_gated_delta_rule"] > before) == (dev == "cuda")
        loss = (o.float() * o.detach().float().cos()).sum()
        if with_state:
            loss = loss + (S * S.detach().sin()).sum()
        grads = torch.autograd.grad(loss, ins[:6] if with_state else ins[:5])
        results.append((o.float().cpu(), None if S is None else S.cpu(),
                        [gr.float().cpu() for gr in grads]))
    (o, S, grads), (o_ref, S_ref, grads_ref) = results
    assert rel(o, o_ref) < 2e-2
    if with_state:
        assert rel(S, S_ref) < 2e-2
    for i, (gr, gr_ref) in enumerate(zip(grads, grads_ref)):
        assert rel(gr, gr_ref) < 3e-2, i


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("packed", [False, True])
def test_bf16_deltanet_on_the_gpu_matches_fp32_on_the_cpu(packed):
    """The DeltaNet layer in bf16 on CUDA (fla where installed) lands as close to fp32 on the
    CPU as the same layer in bf16 on the CPU does (bf16 weights and activations alone put it
    2.4% away; measured on an H100, 2026-12-07, the PyTorch rule on both)."""
    T = 200
    doc_ids = torch.tensor([[0] * 70 + [1] * 130, [0] * 199 + [1]]) if packed else None
    _, _, _, p, shape, x = deltanet_case(T)
    out = {}
    for dev, dt in (("cuda", torch.bfloat16), ("cpu", torch.bfloat16), ("cpu", torch.float32)):
        pd = {n: t.detach().to(dev, dt) for n, t in p.items()}
        docs = None if doc_ids is None else doc_ids.to(dev)
        with torch.no_grad():
            out[dev, dt] = dn.gated_deltanet(shape, pd, x.to(dev, dt), docs).float().cpu()
    ref = out["cpu", torch.float32]
    bf16_cpu = rel(out["cpu", torch.bfloat16], ref)
    assert bf16_cpu < 4e-2
    assert rel(out["cuda", torch.bfloat16], ref) < 1.25 * bf16_cpu


@pytest.mark.parametrize("capability,triton_version,tilelang,refused", [
    ((9, 0), "3.6.0", False, True),  # the reference H100: fla's backward raises there
    ((9, 0), "3.4.0", False, True),
    ((9, 0), "3.7.1", False, False),
    ((9, 0), "3.3.1", False, False),
    ((9, 0), "3.6.0", True, False),  # fla's other backend, tilelang, is installed
    ((8, 9), "3.6.0", False, False),  # Ada (RTX 4090)
    ((12, 0), "3.6.0", False, False)])  # Blackwell consumer cards
def test_fla_is_left_out_where_its_backward_refuses_to_run(monkeypatch, capability,
                                                           triton_version, tilelang, refused):
    import sys
    import types

    from slideformer.engine.kernels import deltanet_gpu
    deltanet_gpu.fla_refused_on.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "tilelang" and tilelang else
                        None if name == "tilelang" else real(name, *a))
    assert deltanet_gpu.fla_refused_on("cuda:0") is refused
    deltanet_gpu.fla_refused_on.cache_clear()
