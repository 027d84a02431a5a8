"""``train.gpus``: a count or "all" in the TOML file, each bad value refused with its key."""
from __future__ import annotations

import pytest

from slideformer.engine import config as config_mod
from slideformer.engine.errors import UserError
from slideformer.engine.validate import validate


def cfg(**train):
    return config_mod.from_dict({"train": train}, "run.toml")


@pytest.mark.parametrize("value", [2, "all"])
def test_a_count_or_all_round_trips_through_toml(tmp_path, value):
    c = cfg(gpus=value, grad_accum=4)
    validate(c, "values")
    path = tmp_path / "run.toml"
    path.write_text(config_mod.dumps(c))
    assert config_mod.load(path).train.gpus == value


@pytest.mark.parametrize("train,key", [
    ({"gpus": 0}, "train.gpus"), ({"gpus": 65}, "train.gpus"), ({"gpus": "two"}, "train.gpus"),
    ({"gpus": 2, "grad_accum": 3}, "train.grad_accum"),
    ({"gpus": 2, "grad_accum": 2, "method": "lora"}, "train.method"),
    ({"gpus": 2, "grad_accum": 2, "device": "cuda:1"}, "train.device")])
def test_bad_values_name_their_key(train, key):
    with pytest.raises(UserError) as e:
        validate(cfg(**train), "values")
    assert key in str(e.value) and e.value.fix


@pytest.mark.parametrize("value", [2.5, True, [2]])
def test_other_types_are_refused_when_read(value):
    with pytest.raises(UserError, match="train.gpus"):
        cfg(gpus=value)
