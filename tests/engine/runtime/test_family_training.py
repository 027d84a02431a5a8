"""Every family trains through the sliding window exactly as transformers trains it (CPU, fp32).

For a tiny random model of each family, built so that every layer type it has is present
(sliding and full layers, a NoPE layer, experts routed top-2 of 4), the sliding executor (2 slots
for 4 layers, 2 micro-batches, exact clipping) and the transformers model itself (the reference:
its own forward, ``torch.optim.AdamW`` with decay on matrices, ``clip_grad_norm_``) take the same
steps: the same loss and gradient norm at every step and the same final weights.

Within what tolerance: fp32 rounding, which AdamW's normalised steps amplify in weights with
small gradients. The test measures it: transformers' model trained once more in float64 gives
the noise, the distance of the fp32 reference from a run without fp32's rounding, and the
sliding run must sit within 4x that distance of the fp32 reference, tensor by tensor. (The noise run used to be
transformers' fp32 model with SDPA attention; the two fp32 runs share every sum but attention's
and came within 2.6e-5 of each other on Qwen3-MoE with a dense layer under transformers 5.25,
while each sat 0.9-1.2e-4 from the float64 run and the sliding run 3.3e-5 from it.) Below FLOOR
every difference passes (measured here: gradient norms 1.4e-6 to 7.9e-6 apart already at step
1, where the losses agree to 1e-7).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from slideformer.engine.config import OptimConfig
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.weights import hf_name, item_layout, item_names, stored_as, stored_views
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.train.schedule import lr_at
from slideformer.engine.train.state import build_host_state, load_weights
from tests.engine.models.test_models import PHI4_ROPE, hf_as_ours
from tests.engine.runtime.test_sliding_equivalence import make_batches

FAMILIES = ["llama", "mixtral", "qwen3_moe", "olmo2", "olmo3", "olmoe", "phi3", "smollm3",
            "gemma3_text", "gpt_oss", "qwen3_5_text", "qwen3_5_moe_text", "gemma4_text"]
STEPS = 3
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, schedule="cosine", warmup_steps=1,
                    max_grad_norm=0.5)
FLOOR = 2e-5
"""Relative differences that fp32 summation order alone makes (see the module docstring)."""
EXTRA = {"mixtral": {"sliding_window": 16}, "phi3": PHI4_ROPE}
"""Mixtral's window (16 of the 24-token rows) on top of its experts; Phi-3 as Phi-4-mini is:
RoPE on 12 of 16 dimensions, LongRoPE (the 24-token rows pass its original context of 16)."""
ALT = {"dtype": torch.float64, "attn_implementation": "eager"}
"""The noise run: the eager model in float64, whose distance from the fp32 run is fp32's
rounding itself."""


def reference_adamw(model, optim) -> tuple[list, torch.optim.AdamW]:
    """(parameters, torch's AdamW over them) with the decay the engine applies: none on vectors,
    norms and biases of any shape (GPT-OSS stacks its experts' biases as matrices)."""
    named = list(model.named_parameters())
    params = [p for _, p in named]
    decayed = [p.dim() > 1 and not (n.endswith("bias") or n.endswith("norm.weight"))
               for n, p in named]
    groups = [{"params": [p for p, d in zip(params, decayed) if d],
               "weight_decay": optim.weight_decay},
              {"params": [p for p, d in zip(params, decayed) if not d], "weight_decay": 0.0}]
    return params, torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                     eps=optim.eps)


def hf_train(model, steps, optim):
    """(losses, gradient norms) of transformers' model trained on ``steps``."""
    params, opt = reference_adamw(model, optim)
    model.train()
    losses, norms = [], []
    for k, mbs in enumerate(steps, start=1):
        tokens = sum(int((mb.labels != -100).sum()) for mb in mbs)
        opt.zero_grad()
        loss = 0.0
        for mb in mbs:
            out = model(input_ids=mb.input_ids)
            z = out.logits  # labels are shifted already
            z = z if z.dtype == torch.float64 else z.float()
            l_mb = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]),
                                                     mb.labels.reshape(-1), ignore_index=-100,
                                                     reduction="sum") / tokens
            if getattr(model.config, "output_router_logits", False):  # the router's loss
                l_mb = l_mb + model.config.router_aux_loss_coef * out.aux_loss / len(mbs)
            l_mb.backward()
            loss += l_mb.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)))
        for g in opt.param_groups:
            g["lr"] = lr_at(k, STEPS, optim)
        opt.step()
        losses.append(loss)
    return losses, norms


def sliding_train(spec, folder, steps, optim):
    backend = CpuBackend()
    host = build_host_state(spec, backend, torch.float32, torch.float32, layer_grads=True)
    load_weights(host, spec, folder)
    ex = SlidingExecutor(spec, backend, host, ExecShape(micro_batch=2, seq_len=24, n_micro=2,
                                                        slots=2), torch.float32)
    losses, norms = [], []
    for k, mbs in enumerate(steps, start=1):
        hyper = lambda coef, k=k: AdamHyper(lr_at(k, STEPS, optim), optim.beta1, optim.beta2,  # noqa: E731
                                            optim.eps, optim.weight_decay, k, coef)
        out = ex.train_step(mbs, hyper, optim.max_grad_norm)
        losses.append(out.loss)
        norms.append(out.grad_norm)
    ex.close()
    return losses, norms, host


AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.05}
"""The router's load-balancing loss on, weighted well above the releases' 0.001 so that a wrong
gradient of it shows in the weights."""
CASES = [pytest.param(a, EXTRA.get(a), id=a) for a in FAMILIES] + [
    pytest.param(a, {**EXTRA.get(a, {}), **AUX}, id=f"{a}-router_aux")
    for a in ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_5_moe_text")] + [
    # OlmoeConfig's own weight (0.01) where config.json names none
    pytest.param("olmoe", {"output_router_logits": True}, id="olmoe-router_aux_default"),
    pytest.param("qwen3_moe", {"mlp_only_layers": [0], **AUX}, id="qwen3_moe-dense_layer-router_aux"),
    # experts beside every dense MLP (transformers' Gemma 4 adds no router loss)
    pytest.param("gemma4_text", {"enable_moe_block": True}, id="gemma4_text-moe")]


@pytest.mark.parametrize("arch,extra", CASES)
def test_family_trains_as_transformers_does(arch, extra, tiny_model_factory, load_hf):
    folder = tiny_model_factory(arch, TinyShape(), extra, seed=1)
    spec = load_spec(folder)
    steps = make_batches(spec, n_micro=2, B=2, T=24, seed=4)[:STEPS]
    ref, alt = load_hf(folder), AutoModelForCausalLM.from_pretrained(
        folder, experts_implementation="eager",
        **ALT)
    ref_losses, ref_norms = hf_train(ref, steps, OPTIM)
    alt_losses, alt_norms = hf_train(alt, steps, OPTIM)
    losses, norms, host = sliding_train(spec, folder, steps, OPTIM)

    def rel(a, b):
        return ((torch.as_tensor(a) - torch.as_tensor(b)).norm() / torch.as_tensor(b).norm()).item()
    final, other = (_weights(spec, m) for m in (ref, alt))
    # each tensor's own noise: its fp32 reference's distance from the float64 run (a model-wide
    # maximum let a 1e-4 gradient error in one layer of OLMoE or SmolLM3 pass)
    noise = {n: rel(other[n].to(t.dtype), t) for n, t in final.items()}
    assert max(noise.values()) < 5e-3  # the fp32 reference itself is sound (Gemma 4: 1.9e-3)
    for what, a, b, c in (("loss", losses, ref_losses, alt_losses),
                          ("gradient norm", norms, ref_norms, alt_norms)):
        assert rel(a, b) <= max(3 * rel(c, b), FLOOR), f"{what}: {a} against {b}"
    assert ref_norms[0] > OPTIM.max_grad_norm  # clipping was in force
    for item in item_names(spec):
        for name, ours in stored_views(spec, item, item_layout(spec, item).views(host[item].master())):
            assert rel(ours, final[name]) <= max(4 * noise[name], FLOOR), \
                f"{name}: relative difference {rel(ours, final[name]):.2e} (noise {noise[name]:.2e})"


def _weights(spec, model) -> dict:
    """transformers' parameters by checkpoint name, one tensor per expert, and Gemma 4's layer
    scalars (buffers there: the engine must leave them as they were)."""
    named = hf_as_ours(spec, {n: p.detach() for n, p in model.named_parameters()})
    named |= {n: b for n, b in model.named_buffers() if n.endswith(".layer_scalar")}
    out = {}
    for item in item_names(spec):
        for local, _, _ in item_layout(spec, item).entries:
            t = named[hf_name(item, local)]
            names = stored_as(spec, item, local)
            out.update(zip(names, t) if len(names) > 1 else [(names[0], t)])
    return out
