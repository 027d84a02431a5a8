"""``train.gpus = 2`` on two CUDA GPUs (NCCL, bf16): the same run as one GPU, within bf16 noise."""
from __future__ import annotations

import pytest
import torch

from test_data_parallel import losses, run_cfg
from slideformer.engine import config as config_mod
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.demo import write_task

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA GPUs")]


def test_two_gpus_train_what_one_does(tmp_path):
    make_tiny_model(tmp_path / "model", "llama", TinyShape(layers=3), seed=4)
    write_task(tmp_path / "train.jsonl", 80, 1)
    runs = {}
    for gpus in (1, 2):
        cfg = config_mod.override(run_cfg(tmp_path, f"gpus{gpus}", gpus, 0.5),
                                  {"train.device": "cuda"})
        assert run_training(cfg) == "finished"
        runs[gpus] = losses(tmp_path / f"gpus{gpus}")
    # bf16 compute: the sums' order differs between 1 and 2 GPUs, so agree to bf16 noise
    torch.testing.assert_close(torch.tensor(runs[2]), torch.tensor(runs[1]), rtol=2e-2, atol=0)
    assert runs[2][-1] < runs[2][0]
