"""Preference objectives on the GPU: the CUDA executor (Triton cross-entropy with per-token
weights, fp32 compute) equals the dense formula reference on the same GPU, and a bf16 DPO step
stays within bf16 rounding of it."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.config import PreferenceConfig
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.runtime.backend import CudaBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.train.schedule import lr_at
from slideformer.engine.train.state import build_host_state, load_weights
from tests.engine.runtime.test_preference_equivalence import (N_MICRO, OPTIM, P, STEPS, T, dense_train,
                                                              pair_steps, with_reference)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
transformers = pytest.importorskip("transformers")


def cuda_steps(steps):
    for mbs in steps:
        for mb in mbs:
            mb.input_ids, mb.labels = mb.input_ids.cuda(), mb.labels.cuda()
    return steps


def sliding(spec, folder, steps, kind, cfg, dtype):
    backend = CudaBackend()
    host = build_host_state(spec, backend, dtype, torch.float32, layer_grads=True)
    load_weights(host, spec, folder)
    ex = SlidingExecutor(spec, backend, host, ExecShape(micro_batch=2 * P, seq_len=T,
                                                        n_micro=N_MICRO, slots=2), dtype)
    ex.objective = (kind, cfg)
    losses = []
    for k, mbs in enumerate(steps, start=1):
        hyper = lambda coef, k=k: AdamHyper(lr_at(k, STEPS, OPTIM), OPTIM.beta1, OPTIM.beta2,  # noqa: E731
                                            OPTIM.eps, OPTIM.weight_decay, k, coef)
        losses.append(ex.train_step(mbs, hyper, OPTIM.max_grad_norm).loss)
    ex.close()
    backend.release_host()  # unpin before the next run pins its own state
    return losses


@pytest.mark.parametrize("kind, cfg", [("dpo", PreferenceConfig(beta=0.5)),
                                       ("simpo", PreferenceConfig(beta=2.0)),
                                       ("orpo", PreferenceConfig(beta=0.1))])
def test_cuda_objective_matches_the_formula(kind, cfg, tiny_model_factory):
    folder = tiny_model_factory("llama", TinyShape(), seed=1)
    spec = load_spec(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    steps = with_reference(cuda_steps(pair_steps(spec)), ref)
    ref_losses = dense_train(ref, steps, kind, cfg)
    losses = sliding(spec, folder, steps, kind, cfg, torch.float32)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    bf16 = sliding(spec, folder, steps, kind, cfg, torch.bfloat16)
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(ref_losses), rtol=3e-2, atol=0)
