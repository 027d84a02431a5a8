"""Windowed attention in config.json: read as transformers reads it, refused beyond the window.

Attention here is full causal. Within the window that is the same model (checked against
transformers with the window set); beyond it transformers' model differs (checked too), so a
run whose sequences exceed the window is refused with one clear message.
"""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import check_window, spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config

WINDOW = {"mistral": {"sliding_window": 8},
          "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
          "qwen3": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}}


@pytest.mark.parametrize("arch,extra,window", [
    ("mistral", {"sliding_window": 4096}, 4096), ("mistral", {"sliding_window": None}, None),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 4096}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1}, 4096),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}, None),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 512, "max_window_layers": 0}, 512),
    ("llama", {"sliding_window": 128, "layer_types": ["full_attention", "sliding_attention"]}, 128),
    ("llama", {"sliding_window": 128, "layer_types": ["full_attention"] * 2}, None)])
def test_window_is_read_as_transformers_does(arch, extra, window):
    cfg = {**tiny_config(arch, TinyShape(layers=2)), **extra}
    assert spec_from_config(cfg).sliding_window == window


def test_longer_sequences_are_refused(tmp_path):
    spec = spec_from_config({**tiny_config("mistral", TinyShape(layers=2)), "sliding_window": 4096})
    check_window(spec, 4096, tmp_path)  # within the window: full attention is the same model
    with pytest.raises(UserError) as e:
        check_window(spec, 8192, tmp_path)
    assert "sliding_window=4096" in str(e.value.problem) and "max_seq_len to at most 4096" in e.value.fix
    assert str(tmp_path / "config.json") in str(e.value.where)


@pytest.mark.parametrize("arch", sorted(WINDOW))
def test_full_attention_equals_transformers_only_within_the_window(arch, tiny_model_factory,
                                                                   load_dense, load_hf):
    folder = tiny_model_factory(arch, TinyShape(layers=2), WINDOW[arch])
    ours, ref = load_dense(folder), load_hf(folder)
    assert ours.spec.sliding_window == 8
    ids = torch.randint(0, ours.spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours.logits(ids), ref(input_ids=ids).logits
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-4, atol=1e-5)  # within: the same
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3  # beyond: transformers' window changes it
