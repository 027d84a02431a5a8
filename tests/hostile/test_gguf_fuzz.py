"""GGUF fuzzing: files cut short at every structural boundary, wrong magic and versions, counts,
offsets, shapes, tensor types and length fields that lie, duplicate keys and tensors, metadata of
the wrong type, tokenizer arrays that disagree, hostile chat templates, NaN weights
(gguf_fuzz's hypothesis strategies), through both readers of a GGUF file: the discovery scan
(``discover_models``, the header reader) and ``import-gguf`` (then the imported folder is loaded
as training loads it).

Every file ends in success or in one UserError naming it (for discovery: an unsupported row
whose reason names it); a file that lies about itself must be refused; another exception is a
bug, and so is a hang or an allocation past 2 GiB (gguf_fuzz.bounded).
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import gguf_fuzz as gf
import pytest
from hostile_corpus import TINY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slideformer.engine.gguf.exporter import export_gguf
from slideformer.engine.models.tiny import make_tiny_model

KINDS = ("f32", "q8_0")
"""The seeds: the tiny model exported with float and with quantised matrices."""


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, gf.GGUFParts]:
    root = tmp_path_factory.mktemp("gguf-fuzz")
    model = make_tiny_model(root / "model", "llama", TINY, seed=5)
    out = {}
    for kind in KINDS:
        raw = export_gguf(model, root / f"{kind}.gguf", kind).read_bytes()
        out[kind] = gf.parse(raw)
        assert gf.encode(out[kind])[0] == raw  # the fuzz's own reader and writer round-trip
    return out


def check_file(seeds, kind: str, chosen, tally: gf.Tally) -> None:
    m = gf.apply_all(seeds[kind], chosen)
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):  # a template's canary
        gf.check_gguf(m, Path(tmp), tally)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                       HealthCheck.filter_too_much])


@settings(max_examples=150, derandomize=True, **_SETTINGS)
@given(kind=st.sampled_from(KINDS), chosen=gf.mutations)
def test_hostile_gguf_files(seeds, kind, chosen):
    check_file(seeds, kind, chosen, gf.Tally())


@pytest.mark.slow
def test_hostile_gguf_files_long(seeds, capsys):
    tally = gf.Tally()

    @settings(max_examples=5000, **_SETTINGS)
    @given(kind=st.sampled_from(KINDS), chosen=gf.mutations)
    def run(kind, chosen):
        check_file(seeds, kind, chosen, tally)

    t0 = time.perf_counter()
    run()
    with capsys.disabled():
        print(f"\n{tally.line(time.perf_counter() - t0)}")
