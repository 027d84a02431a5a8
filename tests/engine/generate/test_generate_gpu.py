"""Generation on CUDA: the streamed window (pinned staging, H2D stream, slot pool) gives the
resident model's tokens, and bf16 logits stay near transformers' on the same weights.
Run on the reference GPU machine."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.generate.cache import KVCache
from slideformer.engine.generate.decoder import forward
from slideformer.engine.generate.sampling import SamplingConfig
from slideformer.engine.generate.session import ChatModel
from slideformer.engine.models.tiny import TinyShape, make_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

QUESTION = [{"role": "user", "content": "What is the sum of two and three?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gen-gpu") / "m", "qwen2",
                           TinyShape(layers=6, hidden=256, heads=8, kv_heads=2,
                                     intermediate=704), seed=5)


def test_cuda_streamed_window_gives_the_resident_tokens(folder):
    resident = ChatModel(folder, mode="resident", device="cuda")
    assert resident.dtype == torch.bfloat16 and resident.device.type == "cuda"
    prompt = resident.prompt_ids(QUESTION)
    cfg = SamplingConfig(temperature=0, max_new_tokens=32)
    expected = list(resident.tokens(prompt, cfg))[:-1]
    for slots in (2, 4):
        streamed = ChatModel(folder, mode="streamed", device="cuda", slots=slots)
        assert list(streamed.tokens(prompt, cfg))[:-1] == expected
        assert list(streamed.tokens(prompt, cfg))[:-1] == expected
        streamed.close()


def test_cuda_bf16_logits_are_near_transformers(folder):
    from transformers import AutoModelForCausalLM
    model = ChatModel(folder, mode="resident", device="cuda")
    prompt = model.prompt_ids(QUESTION)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    cache = KVCache(model.spec, len(prompt), model.dtype, model.device)
    ours = forward(model.spec, model.weights, torch.tensor([prompt], device="cuda"), cache).cpu()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 0.05  # bf16 weights and activations against fp32
