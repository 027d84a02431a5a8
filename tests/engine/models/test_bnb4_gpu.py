"""A *-bnb-4bit folder quantised on the GPU, as releases are made: loaded for qlora as stored, our
NF4 layers dequantise on the GPU to bitsandbytes' own dequantisation of the same weights, and
QLoRA steps stream them through the slots."""
from __future__ import annotations

import math
import shutil

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

from slideformer.engine.config import LoraConfig, OptimConfig  # noqa: E402
from slideformer.engine.models.lora import lora_spec  # noqa: E402
from slideformer.engine.models.spec import load_spec  # noqa: E402
from slideformer.engine.models.tiny import TinyShape, make_tiny_model  # noqa: E402
from slideformer.engine.models.weights import TOKENIZER_FILES, hf_name  # noqa: E402
from slideformer.engine.runtime.backend import CudaBackend  # noqa: E402
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor  # noqa: E402
from slideformer.engine.runtime.host_state import AdamHyper  # noqa: E402
from slideformer.engine.runtime.lora import adapter_name, init_adapters, is_adapter  # noqa: E402
from slideformer.engine.train.state import build_frozen_state, load_weights  # noqa: E402
from tests.engine.runtime.test_sliding_equivalence import make_batches  # noqa: E402


def test_gpu_quantised_folder_loads_as_stored_and_trains(tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama", TinyShape(layers=3, hidden=128, heads=4,
                                                               intermediate=256), seed=41)
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                        bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=q,
                                                            dtype=torch.bfloat16,
                                                            device_map={"": 0})
    folder = tmp_path / "bnb4"
    ref.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, folder / f)
    spec = load_spec(folder)
    lora = lora_spec(LoraConfig(rank=8, alpha=16.0))  # every linear projection of the decoder
    backend = CudaBackend()
    host = build_frozen_state(spec, backend, torch.bfloat16, torch.float32, lora, nf4=True)
    load_weights(host, spec, folder)
    params = dict(ref.named_parameters())
    for i in range(spec.num_layers):
        item = host[f"layer{i}"]
        ours = item.quant.layout.views(item.quant.dequantize(
            item.w.cuda(), torch.empty(item.numel, dtype=torch.bfloat16, device="cuda")))
        for t in item.quant.tensors:
            p = params[hf_name(f"layer{i}", t.name)]
            theirs = bnb.functional.dequantize_4bit(p.data, p.quant_state)  # bf16, on the GPU
            assert torch.equal(ours[t.name], theirs), t.name

    init_adapters({k: v for k, v in host.items() if is_adapter(k)}, seed=3)
    before = host[adapter_name(0)].master()
    optim = OptimConfig(lr=2e-3, schedule="constant", max_grad_norm=1.0)
    ex = SlidingExecutor(spec, backend, host, ExecShape(micro_batch=2, seq_len=64, n_micro=2,
                                                        slots=2), torch.bfloat16, lora=lora)
    losses = []
    for k, mbs in enumerate(make_batches(spec, n_micro=2, B=2, T=64, seed=42)[:2], start=1):
        hyper = lambda coef, k=k: AdamHyper(optim.lr, optim.beta1, optim.beta2,  # noqa: E731
                                            optim.eps, optim.weight_decay, k, coef)
        losses.append(ex.train_step(mbs, hyper, optim.max_grad_norm).loss)
    ex.close()
    after = host[adapter_name(0)].master()
    backend.release_host()  # unpin before the host state is freed (its pages may be reused)
    assert all(math.isfinite(x) for x in losses), losses
    assert not torch.equal(before, after)  # the adapters trained over the stored base
