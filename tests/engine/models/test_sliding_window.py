"""Windowed attention: config.json read as transformers reads it, and computed as it computes it.

A sliding layer's query sees itself and the ``sliding_window - 1`` keys before it (transformers'
``create_sliding_window_causal_mask``). The logits past the window are checked against
transformers, and against full attention, which must differ there (or the check is vacuous).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from slideformer.engine.models.model import DenseModel
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config

WINDOW = {"mistral": {"sliding_window": 8},
          "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
          "qwen3": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
          "smollm3": {"use_sliding_window": True, "sliding_window": 8},
          "gemma3_text": {}, "olmo3": {}, "gpt_oss": {}}


@pytest.mark.parametrize("arch,extra,window", [
    ("mistral", {"sliding_window": 4096}, 4096), ("mistral", {"sliding_window": None}, None),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 4096}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1}, 4096),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}, None),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 512, "max_window_layers": 0}, 512),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 128,
               "layer_types": ["full_attention", "sliding_attention"]}, 128),
    # transformers' Llama reads no layer_types: every layer attends in full
    ("llama", {"sliding_window": 128, "layer_types": ["full_attention", "sliding_attention"]}, None),
    ("gemma3_text", {"sliding_window": 512, "layer_types": None}, 512),
    ("gpt_oss", {"sliding_window": None, "layer_types": None}, 128)])  # GptOssConfig's default
def test_window_is_read_as_transformers_does(arch, extra, window):
    cfg = {**tiny_config(arch, TinyShape(layers=2)), **extra}
    cfg = {k: v for k, v in cfg.items() if v is not None or k == "sliding_window"}
    assert spec_from_config(cfg).sliding_window == window


@pytest.mark.parametrize("arch", sorted(WINDOW))
def test_windowed_attention_equals_transformers(arch, tiny_model_factory, load_dense, load_hf):
    folder = tiny_model_factory(arch, TinyShape(), WINDOW[arch])
    ours, ref = load_dense(folder), load_hf(folder)
    assert ours.spec.sliding_window == 8
    ids = torch.randint(0, ours.spec.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    unwindowed = DenseModel(dataclasses.replace(ours.spec, sliding_window=1 << 20))
    unwindowed.load_state_dict(ours.state_dict())
    with torch.no_grad():
        a, b, full = ours.logits(ids), ref(input_ids=ids).logits, unwindowed.logits(ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(full[:, :8], a[:, :8], rtol=1e-4, atol=1e-5)  # within: the same
    assert (full[:, 8:] - a[:, 8:]).abs().max() > 1e-3  # beyond: the window changes them


def test_packed_windowed_documents_equal_separate_runs(tiny_model_factory, load_dense):
    """The window and the document boundary together: each document as if alone."""
    model = load_dense(tiny_model_factory("mistral", TinyShape(), WINDOW["mistral"]))
    ids = torch.randint(0, model.spec.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    doc_ids = (torch.arange(30) >= 13).long()[None]
    with torch.no_grad():
        packed = model.logits(ids, doc_ids)
        torch.testing.assert_close(packed[:, :13], model.logits(ids[:, :13]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(packed[:, 13:], model.logits(ids[:, 13:]), rtol=1e-5, atol=1e-6)
