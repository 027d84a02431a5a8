"""slideformer.engine.validate: every field's type, range and choices, each refused with a message naming it."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slideformer.engine import config as config_mod
from slideformer.engine.config import parse_bytes
from slideformer.engine.errors import UserError
from slideformer.engine.validate import validate

GOOD = config_mod.from_dict({"model": {"path": "m"}, "data": {"train": "d.jsonl"}})

# key -> values that must be refused (each names the key)
BAD = {
    "optim.lr": [0.0, -1e-5, math.nan, math.inf, 10.0],
    "optim.beta1": [1.0, 1.5, -0.1, math.nan],
    "optim.beta2": [1.0, -1e-9],
    "optim.eps": [0.0, -1e-8, math.inf],
    "optim.weight_decay": [-0.1, math.nan],
    "optim.max_grad_norm": [-1.0, math.nan, math.inf],
    "optim.warmup_steps": [-1, 10**12],
    "optim.min_lr_ratio": [-0.5, 1.5],
    "optim.schedule": ["triangle"],
    "optim.moments_dtype": ["float16"],
    "train.micro_batch": [0, -3, 10**8],
    "train.grad_accum": [0, 10**8],
    "train.max_steps": [-1, 10**15],
    "train.seed": [-1, 2**64],
    "train.compute_dtype": ["fp8"],
    "train.precision": ["fp32", "amp", ""],
    "train.device": ["tpu", "cuda:x", "cuda:12345"],
    "train.save_every": [-1],
    "train.keep_checkpoints": [0],
    "train.eval_every": [-2],
    "data.max_seq_len": [0, 1, 10**9],
    "data.val_fraction": [-0.1, 1.0, math.nan],
    "data.seed": [-5],
    "data.format": ["csv"],
    "data.train_on": ["everything"],
    "data.truncation": ["wrap"],
    "budget.vram": ["-1GiB", "0", "lots", "1e400GiB", "infGiB", "nan"],
    "budget.ram": ["1e400GiB", "2EiB"],
    "budget.slots": [-1, 10**9],
    "budget.checkpoints": ["disk"],
    "budget.gpu_layers": [-2, 10**9],
    "budget.nvme_size": ["1e400GiB", "10GiB"],
    "output.shard_size": ["0", "big", "1e400TB"],
    "output.run_dir": ["", "  "],
    "model.path": [""],
}


def _with(key: str, value):
    section, name = key.split(".")
    sec = dataclasses.replace(getattr(GOOD, section), **{name: value})
    return dataclasses.replace(GOOD, **{section: sec})


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD.items() for v in vs])
def test_each_bad_value_is_refused_naming_its_key(key, value):
    with pytest.raises(UserError) as e:
        validate(_with(key, value))
    assert key in str(e.value), str(e.value)
    assert e.value.fix


def test_defaults_with_a_model_and_data_pass():
    assert validate(GOOD) is GOOD
    assert validate(config_mod.RunConfig(), "values")


def test_infinite_epochs_are_refused_only_when_they_decide_the_length():
    with pytest.raises(UserError, match="train.epochs"):
        validate(_with("train.epochs", math.inf))
    with pytest.raises(UserError, match="train.epochs"):
        validate(_with("train.epochs", 0.0))
    ok = dataclasses.replace(GOOD, train=dataclasses.replace(GOOD.train, epochs=math.inf,
                                                             max_steps=10))
    assert validate(ok) is ok


def test_purpose_decides_what_must_be_set():
    no_data = dataclasses.replace(GOOD, data=dataclasses.replace(GOOD.data, train=""))
    with pytest.raises(UserError, match="data.train"):
        validate(no_data, "train")
    assert validate(no_data, "plan") is no_data


def test_wrong_python_types_are_refused():
    # what a front end that builds a RunConfig in code (skipping the TOML checks) could pass
    for key, value in (("train.micro_batch", "2"), ("optim.lr", "1e-5"), ("data.packing", 1),
                       ("train.max_steps", True), ("budget.vram", 24)):
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            validate(_with(key, value))


@pytest.mark.parametrize("text", ["1e400GiB", "inf", "-inf", "nan", "1e19EB", "2048PiB"])
def test_parse_bytes_refuses_infinite_and_absurd_sizes(text):
    with pytest.raises(UserError):
        parse_bytes(text, "budget.ram")


def test_parse_bytes_reads_ordinary_sizes():
    assert parse_bytes("24GiB") == 24 << 30
    assert parse_bytes("1.5 TB") == 1_500_000_000_000
    assert parse_bytes("0") == 0


_FIELDS = [(s.name, f.name) for s in dataclasses.fields(config_mod.RunConfig)
           for f in dataclasses.fields(s.default_factory)]  # type: ignore[misc]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
                    st.lists(st.integers(), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=4))
def test_fuzzed_configs_are_accepted_or_refused_with_a_user_error(changes):
    """Any TOML-like values: from_dict + validate either accept them or raise UserError."""
    data = config_mod.to_dict(GOOD)
    for (section, name), value in changes.items():
        data[section][name] = value
    try:
        validate(config_mod.from_dict(data, "fuzz"))
    except UserError as e:
        assert e.where and e.fix
