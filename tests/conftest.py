"""Shared fixtures.

Model folders handed out here are built once per session and shared between tests: treat them as
read-only, and copy one (``shutil.copytree``) before breaking it on purpose.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slideformer.engine.models.model import DenseModel
from slideformer.engine.models.spec import SUPPORTED, load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.models.weights import Checkpoint


# ---- tiny model folders ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(arch, shape=TinyShape(), extra_config=None, seed=0) -> folder``, each built once."""
    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", shape: TinyShape = TinyShape(), extra_config: dict | None = None,
             seed: int = 0) -> Path:
        key = (arch, shape, json.dumps(extra_config, sort_keys=True), seed)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}") / "model"
            built[key] = make_tiny_model(out, arch, shape, seed, extra_config=extra_config)
        return built[key]

    return make


@pytest.fixture(scope="session", params=SUPPORTED)
def tiny_model(request, tiny_model_factory) -> Path:
    """A tiny model folder (default odd shape) of each supported family, in turn."""
    return tiny_model_factory(request.param)


# ---- loaders -----------------------------------------------------------------------------------
def _load_dense(model_dir: Path, dtype: torch.dtype = torch.float32) -> DenseModel:
    spec = load_spec(model_dir)
    model = DenseModel(spec, dtype=dtype)
    ckpt = Checkpoint(model_dir)
    with torch.no_grad():
        for item, flat, _ in model.items():
            ckpt.read_item(spec, item, flat)
    ckpt.close()
    return model


def _load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    # eager attention: the reference should not share our SDPA path
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def load_dense():
    """``load(model_dir, dtype=float32) -> DenseModel`` with the folder's weights."""
    return _load_dense


@pytest.fixture(scope="session")
def load_hf():
    """``load(model_dir) -> transformers model`` (fp32, eager attention, eval mode)."""
    return _load_hf
