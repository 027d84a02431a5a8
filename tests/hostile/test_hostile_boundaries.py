"""Hostile inputs, category boundaries: shard indexes pointing outside the model folder, the
upper limits of the run config, and the compiled CPU AdamW cache.

Each case runs ``slideformer`` in-process and must exit 2 with one message naming the file or key
(tests/hostile/hostile_corpus.py; test_hostile_corpus.py runs the same cases in a subprocess).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hostile_corpus import BOUNDARIES, make_workspace, params, run_in_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-boundaries"))


@pytest.mark.parametrize("case", params(BOUNDARIES))
def test_boundaries_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)


# ---- the compiled CPU AdamW cache -------------------------------------------------------------
@pytest.fixture()
def fresh_kernel(monkeypatch, tmp_path):
    """cpu_adam as if this process had not built it yet, caching under tmp_path."""
    from slideformer.engine.kernels import cpu_adam
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SLIDEFORMER_NO_NATIVE_ADAM", raising=False)
    for name, value in (("_lib", None), ("_tried", False), ("BUILD_ERROR", "")):
        monkeypatch.setattr(cpu_adam, name, value)
    return cpu_adam


def test_kernel_cache_is_private_and_keyed_by_cpu_features(fresh_kernel, monkeypatch, tmp_path):
    import shutil
    import stat
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    folder = tmp_path / "cache" / "slideformer" / "kernels"
    folder.mkdir(parents=True, mode=0o777)
    folder.chmod(0o777)  # a folder others could write to is made private before use
    monkeypatch.setattr(fresh_kernel, "cpu_features", lambda: "fpu sse2 avx2")
    assert fresh_kernel.native_available()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    first = {p.name for p in folder.glob("*.so")}
    monkeypatch.setattr(fresh_kernel, "_tried", False)
    monkeypatch.setattr(fresh_kernel, "cpu_features", lambda: "fpu sse2")  # another CPU
    assert fresh_kernel.native_available()
    both = {p.name for p in folder.glob("*.so")}
    assert len(first) == 1 and len(both) == 2  # never the other CPU's library


def test_missing_compiler_is_reported_and_planned_with_the_fallback_rate(fresh_kernel,
                                                                         monkeypatch):
    from slideformer.engine import config as config_mod
    from slideformer.engine.models.tiny import TinyShape, tiny_config
    from slideformer.engine.models.spec import spec_from_config
    from slideformer.engine.plan.hardware import FALLBACK_SHARE
    from slideformer.engine.plan.planner import plan_run
    from slideformer.engine.plan.targets import load_profile
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert not fresh_kernel.native_available()
    assert "cannot run" in fresh_kernel.unavailable_reason()
    monkeypatch.setattr("slideformer.engine.plan.hardware.cache_file", lambda: Path("/nonexistent/hw.json"))
    spec = spec_from_config(tiny_config("llama", TinyShape()))
    cfg = config_mod.from_dict({"model": {"path": "m"}, "budget": {"ram": "8GiB"}})
    plan = plan_run(cfg, spec, device="cpu")
    compiled = load_profile("this").adam_params_per_s  # what this machine plans with a compiler
    assert plan.hardware.adam_params_per_s == pytest.approx(FALLBACK_SHARE * compiled)
    assert any("compiled CPU AdamW unavailable" in n for n in plan.hardware.notes)
