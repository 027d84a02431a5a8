"""LoRA through the sliding engine equals a dense PEFT LoRA run (CPU, fp32), step for step.

The reference is transformers + peft.get_peft_model + torch.optim.AdamW + clip_grad_norm_ over
the adapters; both sides start from the same adapter weights (ours, copied into PEFT's A and B)
and see the same batches.
"""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from slideformer.engine.config import LoraConfig, OptimConfig  # noqa: E402
from slideformer.engine.models.lora import LoraForward, adapter_layout, for_model, lora_spec  # noqa: E402
from slideformer.engine.models.layers import decoder_layer, rope_tables  # noqa: E402
from slideformer.engine.models.model import positions_for  # noqa: E402
from slideformer.engine.models.spec import load_spec  # noqa: E402
from slideformer.engine.models.tiny import TinyShape, make_tiny_model  # noqa: E402
from slideformer.engine.runtime.backend import CpuBackend  # noqa: E402
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor  # noqa: E402
from slideformer.engine.runtime.host_state import AdamHyper  # noqa: E402
from slideformer.engine.runtime.lora import adapter_name, init_adapters  # noqa: E402
from slideformer.engine.train.schedule import lr_at  # noqa: E402
from slideformer.engine.models.weights import write_hf_folder  # noqa: E402
from slideformer.engine.train.state import build_frozen_state, load_weights, master_tensors  # noqa: E402
from tests.engine.runtime.test_sliding_equivalence import STEPS, make_batches  # noqa: E402

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def peft_model(model_dir, lora, host, spec):
    """The HF model with PEFT adapters whose A and B are copied from our host items."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                          target_modules=list(lora.targets), use_rslora=lora.rslora)
    model = peft.get_peft_model(base, cfg)
    params = dict(model.named_parameters())
    for i in range(spec.num_layers):
        item = host[adapter_name(i)]
        for local, view in item.layout.views(item.master()).items():
            name = f"base_model.model.model.layers.{i}.{local.replace('.weight', '.default.weight')}"
            with torch.no_grad():
                params[name].copy_(view)
    return model


def adapter_params(model, spec, lora, i):
    """PEFT's adapter tensors of layer i, flattened in our layout's order."""
    params = dict(model.named_parameters())
    return torch.cat([torch.zeros(0)] + [params[f"base_model.model.model.layers.{i}."
                             f"{local.replace('.weight', '.default.weight')}"].detach().reshape(-1)
                      for local in adapter_layout(spec, lora, i).names()])


def peft_steps(model, steps, optim: OptimConfig):
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                            eps=optim.eps, weight_decay=optim.weight_decay)
    losses = []
    for k, mbs in enumerate(steps, start=1):
        tokens = sum(int((mb.labels != -100).sum()) for mb in mbs)
        opt.zero_grad()
        total = 0.0
        for mb in mbs:
            z = model(input_ids=mb.input_ids).logits.float()
            loss = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]),
                                                     mb.labels.reshape(-1), ignore_index=-100,
                                                     reduction="sum") / tokens
            loss.backward()
            total += loss.item()
        if optim.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(trained, optim.max_grad_norm)
        for g in opt.param_groups:
            g["lr"] = lr_at(k, STEPS, optim)
        opt.step()
        losses.append(total)
    return losses


def lora_host(spec, model_dir, lora, seed=0, nf4=False, tier=None):
    """Frozen base + adapters with PEFT's init of A and a random B (so the first step already
    moves the output and both A and B get gradients); ``tier``: base layers on the NVMe tier."""
    host = build_frozen_state(spec, CpuBackend(), torch.float32, torch.float32, lora, nf4=nf4,
                              tier=tier)
    load_weights(host, spec, model_dir)
    init_adapters({k: v for k, v in host.items() if k.startswith("lora")}, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(spec.num_layers):
        item = host[adapter_name(i)]
        flat = item.master()
        for name, view in item.layout.views(flat).items():
            if ".lora_B." in name:
                view.copy_(0.05 * torch.randn(view.shape, generator=g))
        item.set_master(flat)
    return host


def run_lora(spec, host, lora, steps, optim, shape):
    ex = SlidingExecutor(spec, CpuBackend(), host, shape, torch.float32, lora=lora)
    losses = []
    for k, mbs in enumerate(steps, start=1):
        hyper = lambda coef, k=k: AdamHyper(lr_at(k, STEPS, optim), optim.beta1, optim.beta2,  # noqa: E731
                                            optim.eps, optim.weight_decay, k, coef)
        losses.append(ex.train_step(mbs, hyper, optim.max_grad_norm).loss)
    ex.close()
    return losses


ADAPTER_TOL = {"gemma4_text": 1e-4}
"""Adapters' relative difference allowed where fp32 rounding alone reaches 1e-5 (else 1e-5).
Gemma 4 does not scale its scores (normed q and k: scores up to head_dim, a peaked softmax), so
rounding grows from layer to layer, and Adam's first step normalises the gradients of entries
that cancel to ~1e-6 of the largest. Measured on the tiny model (3 steps): PEFT in fp32 and in
fp64 differ by 3.9e-4 in layer 0's adapters, the engine and fp64 PEFT by 4.2e-4, the engine and
fp32 PEFT by 2.8e-5 (1.1e-5 with experts)."""


def assert_same(spec, lora, host, model, losses, ref_losses, atol: float = 0.0):
    """``atol``: for losses near zero (GRPO's), whose rounding is that of their terms."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=atol)
    tol = ADAPTER_TOL.get(spec.model_type, 1e-5)
    for i in range(spec.num_layers):
        a, b = host[adapter_name(i)].master(), adapter_params(model, spec, lora, i)
        if not b.numel():  # a layer with none of the targets (a gated DeltaNet layer of an MoE)
            assert not a.numel()
            continue
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < tol, f"layer {i} adapters: relative difference {rel:.2e}"


EXTRA = {"qwen3_moe-dense_layer": ("qwen3_moe", {"mlp_only_layers": [1]}),
         "qwen3_5_text": ("qwen3_5_text", {"layer_types": [
             "linear_attention", "full_attention", "linear_attention"]}),
         "qwen3_5_moe_text": ("qwen3_5_moe_text", {"layer_types": [
             "linear_attention", "full_attention", "linear_attention"]}),
         "gemma4_text-moe": ("gemma4_text", {"enable_moe_block": True})}
"""Layers of two shapes: Qwen3-MoE's dense layer among sparse ones (the dense one's MLP is not
adapted either), Qwen3.5's gated DeltaNet layers (their MLP adapted, the attention of the full
layer too), Gemma 4's experts beside the dense MLP (which PEFT adapts) of sliding and full
layers (no v_proj: its keys are the values)."""


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmoe",
                                        "phi3", "gemma3_text", "gpt_oss", "gemma4_text", *EXTRA])
def family_model(request, tmp_path_factory):
    arch, extra = EXTRA.get(request.param, (request.param, None))
    d = make_tiny_model(tmp_path_factory.mktemp(arch) / "m", arch,
                        TinyShape(layers=3, tie=(arch == "qwen2")), seed=11, extra_config=extra)
    return load_spec(d), d


@pytest.fixture(scope="module")
def llama_models(tmp_path_factory):
    """Untied (False) and tied (True) tiny llama models."""
    out = {}
    for tie in (False, True):
        d = make_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama",
                            TinyShape(layers=3, tie=tie), seed=13)
        out[tie] = load_spec(d), d
    return out


OPTIM = OptimConfig(lr=5e-3, weight_decay=0.1, schedule="cosine", warmup_steps=1,
                    max_grad_norm=0.5)


def test_family_matches_peft(family_model):
    """Every family (qwen2 tied), all seven projections (an MoE's attention ones, Phi-3's two
    fused ones), K=2 of 3 layers, clipping on."""
    spec, d = family_model
    lora = for_model(lora_spec(LoraConfig(rank=4, alpha=8.0, target_modules=ALL)), spec)
    steps = make_batches(spec, n_micro=2, B=1, T=16, seed=12)
    host = lora_host(spec, d, lora)
    model = peft_model(d, lora, host, spec)
    ref_losses = peft_steps(model, steps, OPTIM)
    losses = run_lora(spec, host, lora, steps, OPTIM,
                      ExecShape(micro_batch=1, seq_len=16, n_micro=2, slots=2))
    assert_same(spec, lora, host, model, losses, ref_losses)
    assert ref_losses[-1] != ref_losses[0]


@pytest.mark.parametrize("slots,clip,targets,rslora,tie", [
    (1, 0.0, "q_proj,v_proj", False, False), (3, 1e-3, ALL, True, True),
    (2, 0.0, "o_proj,down_proj,up_proj", False, True), (4, 0.5, ALL, False, False)])
def test_variants_match_peft(llama_models, slots, clip, targets, rslora, tie):
    """Slot counts (1 .. all layers), clipping off / tiny / moderate, target subsets, rsLoRA,
    tied and untied embeddings."""
    spec, d = llama_models[tie]
    lora = lora_spec(LoraConfig(rank=3, alpha=6.0, target_modules=targets, use_rslora=rslora))
    optim = OptimConfig(lr=4e-3, weight_decay=0.05, schedule="linear", max_grad_norm=clip)
    steps = make_batches(spec, n_micro=2, B=2, T=12, seed=14)
    host = lora_host(spec, d, lora, seed=3)
    model = peft_model(d, lora, host, spec)
    ref_losses = peft_steps(model, steps, optim)
    losses = run_lora(spec, host, lora, steps, optim,
                      ExecShape(micro_batch=2, seq_len=12, n_micro=2, slots=slots))
    assert_same(spec, lora, host, model, losses, ref_losses)


def test_feed_forward_tiles_match_peft(llama_models, monkeypatch):
    """A micro-batch's feed-forward in tiles of 5 tokens (2 x 12 tokens: models.layers.tiles),
    forward and recompute + backward (in tiles of 2 query positions: query_tiled_grads), all
    seven projections adapted: the same as PEFT."""
    from slideformer.engine.runtime import backward
    calls = []
    real = backward.query_tiled_grads
    monkeypatch.setattr(backward, "query_tiled_grads",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    spec, d = llama_models[False]
    lora = lora_spec(LoraConfig(rank=3, alpha=6.0, target_modules=ALL))
    steps = make_batches(spec, n_micro=2, B=2, T=12, seed=15)
    host = lora_host(spec, d, lora, seed=4)
    model = peft_model(d, lora, host, spec)
    ref_losses = peft_steps(model, steps, OPTIM)
    losses = run_lora(spec, host, lora, steps, OPTIM,
                      ExecShape(micro_batch=2, seq_len=12, n_micro=2, slots=2, ff_tokens=5))
    assert_same(spec, lora, host, model, losses, ref_losses)
    assert len(calls) == spec.num_layers * 2 * len(steps)  # every layer, micro-batch and step


@pytest.mark.parametrize("slots,clip", [(1, 0.5), (2, 0.0)])
def test_qlora_matches_peft_lora_on_the_dequantised_base(llama_models, tmp_path, slots, clip):
    """QLoRA (NF4 base bytes in the slots, dequantised on use) is LoRA over the NF4-rounded
    base: equal to PEFT LoRA on a model folder holding the dequantised weights."""
    spec, d = llama_models[False]
    lora = lora_spec(LoraConfig(rank=4, alpha=8.0, target_modules=ALL))
    host = lora_host(spec, d, lora, nf4=True)
    assert host["layer0"].w.dtype == torch.uint8 and host["layer0"].w.numel() < spec.params_per_layer
    deq = write_hf_folder(tmp_path / "deq", spec, master_tensors(host, spec), dtype=torch.float32,
                          tokenizer_dir=d)
    optim = OptimConfig(lr=4e-3, weight_decay=0.05, schedule="linear", max_grad_norm=clip)
    steps = make_batches(spec, n_micro=2, B=1, T=12, seed=18)
    model = peft_model(deq, lora, host, spec)
    ref_losses = peft_steps(model, steps, optim)
    losses = run_lora(spec, host, lora, steps, optim,
                      ExecShape(micro_batch=1, seq_len=12, n_micro=2, slots=slots))
    assert_same(spec, lora, host, model, losses, ref_losses)


def test_base_is_never_written(tmp_path):
    """The frozen base items keep their loaded weights bit for bit."""
    d = make_tiny_model(tmp_path / "m", "qwen3", TinyShape(layers=2), seed=15)
    spec = load_spec(d)
    lora = lora_spec(LoraConfig())
    host = lora_host(spec, d, lora)
    before = {n: it.w.clone() for n, it in host.items() if not n.startswith("lora")}
    run_lora(spec, host, lora, make_batches(spec, 1, B=1, T=8, seed=16), OPTIM,
             ExecShape(micro_batch=1, seq_len=8, n_micro=1, slots=1))
    for n, w in before.items():
        assert torch.equal(host[n].w, w), n


def test_dropout_recompute_reuses_the_mask(tmp_path):
    """With dropout, the backward's recompute draws the forward's mask: recomputing a layer
    with the same seed gives the same output, another micro-batch's seed a different one,
    and the mask keeps about 1 - p of the inputs."""
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=1), seed=17)
    spec = load_spec(d)
    lora = lora_spec(LoraConfig(dropout=0.3, rank=4))
    host = lora_host(spec, d, lora)
    ex = SlidingExecutor(spec, CpuBackend(), host,
                         ExecShape(micro_batch=1, seq_len=16, n_micro=2, slots=1),
                         torch.float32, lora=lora, seed=5)
    ex._ensure_device_state()
    x = torch.randn(1, 16, spec.hidden_size)
    rope = rope_tables(spec, positions_for(torch.zeros(1, 16, dtype=torch.long), None), x.dtype)
    p = spec.layer_layout.views(host["layer0"].w)
    run = lambda mb, train: decoder_layer(spec, p, x, rope, None, lora=ex._adapters(0, mb, train))  # noqa: E731
    torch.testing.assert_close(run(0, True), run(0, True), rtol=0, atol=0)
    assert not torch.equal(run(0, True), run(1, True))
    assert not torch.equal(run(0, True), run(0, False))
    lf = ex._adapters(0, 0, True)
    kept = (lf._dropout("self_attn.q_proj", torch.ones(64, 256)) != 0).float().mean().item()
    assert abs(kept - 0.7) < 0.02
    # the dropped-out forward is what the backward's recompute differentiates
    item = ex.dev[adapter_name(0)]
    leaves = {k: v.detach().requires_grad_() for k, v in item.layout.views(item.w).items()}
    y = decoder_layer(spec, p, x, rope, None,
                      lora=LoraForward(lora, leaves, ex._dropout_seed(0, 0, True)))
    torch.testing.assert_close(y, run(0, True), rtol=0, atol=0)
    ex.close()
