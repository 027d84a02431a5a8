"""Model discovery on a synthetic machine: a Hugging Face hub cache, an Ollama store, LM Studio's
folder and a folder of the user's, each row against what is computed here independently (file
sizes summed, specs loaded from the folders, GGUF files read by the gguf package and imported,
plans made by ``plan_for_config``)."""
from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

from slideformer.engine.api import RunConfig, UserError, override, plan_for_config
from slideformer.engine.cli import main
from slideformer.engine.gguf.exporter import export_gguf
from slideformer.engine.gguf.importer import import_gguf
from slideformer.engine.models.discover import discover_models
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.stores import default_roots
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.plan import planner, targets
from slideformer.engine.plan.machine import HostMemory
from tools.synthetic_stores import folder_files, hub_entry, ollama_entry, write_manifest

GiB = 1 << 30
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "torch_dtype": "bfloat16", "rope_theta": 500000.0,
            "max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny model folders the stores are made of (built once: read-only)."""
    root = tmp_path_factory.mktemp("discover-src")
    llama = make_tiny_model(root / "llama", "llama", TinyShape(layers=2))
    moe = make_tiny_model(root / "moe", "qwen3_moe", TinyShape(layers=2))
    q8 = export_gguf(llama, root / "llama-q8.gguf", "q8_0")
    return {"llama": llama, "moe": moe, "gguf": q8,
            "imported": import_gguf(q8, root / "imported")}


@pytest.fixture
def machine(tmp_path, monkeypatch, models):
    """A home folder with every store, the environment pointing at it, and fixed memory (so
    two plans of one model word their reason alike)."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USERPROFILE", str(home))
    for var in ("HF_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    memory = HostMemory(total=32 * GiB, available=24 * GiB, own=0)
    for module in (planner, targets):
        monkeypatch.setattr(module, "host_memory", lambda: memory)
        monkeypatch.setattr(module, "gpu_memory", lambda: None)

    cache = tmp_path / "hf" / "hub"
    snaps = {"org/tiny-llama": hub_entry(cache, "org/tiny-llama", folder_files(models["llama"])),
             "org/tiny-moe": hub_entry(cache, "org/tiny-moe", folder_files(models["moe"]))}
    snaps["meta/llama-8b"] = hub_entry(cache, "meta/llama-8b",
                                       {"config.json": json.dumps(LLAMA_8B).encode()})
    snaps["state-spaces/mamba"] = hub_entry(cache, "state-spaces/mamba", {"config.json": json.dumps(
        {"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24}).encode()})
    snaps["org/broken"] = hub_entry(cache, "org/broken", {"config.json": b'{"model_type": "lla'})
    hub_entry(cache, "org/dataset", {"data.jsonl": b"{}"}).parents[1].rename(
        cache / "datasets--org--dataset")  # not a model: not listed

    ollama = tmp_path / "ollama"
    shutil.copyfile(models["gguf"], tmp_path / "q8.gguf")
    blob = ollama_entry(ollama, "tinyllama:latest", tmp_path / "q8.gguf")
    write_manifest(ollama, "library", "tinyllama", "q8", blob.name.removeprefix("sha256-"), 1)
    write_manifest(ollama, "library", "ghost", "1b", "f" * 64, 1)  # its blob is not there

    lms = home / ".lmstudio" / "models" / "pub" / "tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copyfile(models["gguf"], lms / "tiny-Q8_0.gguf")
    data = models["gguf"].read_bytes()
    (lms / "cut-Q8_0.gguf").write_bytes(data[:len(data) // 2])  # a download cut short
    (lms / "mmproj-tiny-f16.gguf").write_bytes(data)  # a vision projector: not a model
    return {"home": home, "cache": cache, "snaps": snaps, "blob": blob, "lms": lms,
            "ollama": ollama}


def _rows(folders=()):
    return {(r.source, r.name): r for r in discover_models(folders)}


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def _reference_fits(folder: Path) -> list[tuple[str, str, str]]:
    plans = [plan_for_config(override(RunConfig(), {"model.path": str(folder),
                                                    "train.method": m}), "this")
             for m in ("full", "lora", "qlora")]
    return [(p.method, p.verdict, p.reason) for p in plans]


def _error(fn, *args) -> str:
    with pytest.raises(UserError) as e:
        fn(*args)
    return str(e.value)


def test_the_env_vars_name_the_stores(machine, monkeypatch, tmp_path):
    roots = default_roots()
    assert roots.hf_cache == machine["cache"] and roots.ollama == (machine["ollama"],)
    assert roots.lm_studio[0] == machine["home"] / ".lmstudio" / "models"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert default_roots().hf_cache == tmp_path / "elsewhere"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    assert default_roots().hf_cache == machine["home"] / ".cache" / "huggingface" / "hub"


def test_hf_cache_rows_match_the_folders(machine, models):
    rows = _rows()
    assert [k for k in rows if k[0] == "hf-cache"] == [
        ("hf-cache", n) for n in ("meta/llama-8b", "org/broken", "org/tiny-llama",
                                  "org/tiny-moe", "state-spaces/mamba")]
    for name, src in (("org/tiny-llama", models["llama"]), ("org/tiny-moe", models["moe"])):
        r, spec = rows["hf-cache", name], load_spec(src)
        assert r.supported and not r.config_only and r.reason == "" and r.format == "hf"
        assert r.path == str(machine["snaps"][name].resolve())
        assert (r.family, r.total_params, r.active_params, r.dtype) == (
            spec.model_type, spec.num_params, spec.active_params, spec.torch_dtype)
        assert r.size == _size(src)
        assert [(f.method, f.verdict, f.reason) for f in r.fits] == _reference_fits(src)
    moe = rows["hf-cache", "org/tiny-moe"]
    assert moe.active_params < moe.total_params

    big = rows["hf-cache", "meta/llama-8b"]
    assert big.supported and big.config_only and big.total_params == load_spec(
        machine["snaps"]["meta/llama-8b"]).num_params
    assert [(f.method, f.verdict, f.reason) for f in big.fits] == _reference_fits(
        machine["snaps"]["meta/llama-8b"])
    assert {f.verdict for f in big.fits} == {"does not fit", "fits"}  # only QLoRA fits 22 GiB


def test_unsupported_and_broken_entries_are_rows_with_the_engines_message(machine):
    rows = _rows()
    mamba = rows["hf-cache", "state-spaces/mamba"]
    assert (mamba.supported, mamba.family, mamba.fits, mamba.total_params) == (False, "mamba", (), None)
    assert mamba.reason == _error(load_spec, machine["snaps"]["state-spaces/mamba"])
    assert "model_type 'mamba' is not supported" in mamba.reason
    broken = rows["hf-cache", "org/broken"]
    assert (broken.supported, broken.family) == (False, None)
    assert broken.reason == _error(load_spec, machine["snaps"]["org/broken"])
    assert "is not valid JSON" in broken.reason

    ghost = rows["ollama", "ghost:1b"]
    assert not ghost.supported and ghost.format == "gguf"
    assert f"{machine['ollama'] / 'blobs' / ('sha256-' + 'f' * 64)}: is missing" in ghost.reason
    assert "ollama pull ghost:1b" in ghost.reason

    cut = rows["lm-studio", "cut-Q8_0"]
    assert not cut.supported and "cannot be read as GGUF" in cut.reason and "cut short" in cut.reason
    assert ("lm-studio", "mmproj-tiny-f16") not in rows


def test_gguf_rows_match_the_file_and_its_import(machine, models):
    rows = _rows()
    reader = gguf.GGUFReader(models["gguf"])
    weights = Counter()
    for t in reader.tensors:
        weights[t.tensor_type.name] += int(t.n_elements)
    imported = load_spec(models["imported"])
    tags = [rows["ollama", "tinyllama:latest"], rows["ollama", "tinyllama:q8"]]
    assert tags[0].path == tags[1].path == str(machine["blob"])  # two tags, one blob
    for r in tags + [rows["lm-studio", "tiny-Q8_0"]]:
        assert r.supported and r.format == "gguf" and not r.config_only
        assert (r.family, r.total_params, r.active_params) == (
            imported.model_type, imported.num_params, imported.active_params)
        assert r.dtype == weights.most_common(1)[0][0] == "Q8_0"
        assert r.size == models["gguf"].stat().st_size
        assert [(f.method, f.verdict, f.reason) for f in r.fits] == _reference_fits(
            models["imported"])


def test_an_unsupported_gguf_says_what_import_would(machine, tmp_path):
    f = machine["lms"] / "gpt2.gguf"
    w = gguf.GGUFWriter(f, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    row = _rows()["lm-studio", "gpt2"]
    assert (row.supported, row.family) == (False, "gpt2")
    assert row.reason == _error(import_gguf, f, tmp_path / "out")


def test_folders_are_searched_two_levels_deep(machine, models, tmp_path):
    mine = tmp_path / "mine"
    shutil.copytree(models["llama"], mine / "a" / "b" / "deep-llama")  # 3 levels: not searched
    shutil.copytree(models["llama"], mine / "team" / "llama")
    shutil.copyfile(models["gguf"], mine / "team" / "export.gguf")
    shutil.copytree(models["moe"], tmp_path / "just-moe")
    rows = _rows([mine, tmp_path / "just-moe", tmp_path / "gone"])
    found = sorted(k[1] for k in rows if k[0] == "folder")
    assert found == ["export", "gone", "just-moe", "team/llama"]
    assert rows["folder", "team/llama"].size == _size(models["llama"])
    assert rows["folder", "just-moe"].family == "qwen3_moe"
    gone = rows["folder", "gone"]
    assert not gone.supported and "is not a folder" in gone.reason


def test_without_huggingface_hub_the_cache_reads_the_same(machine, monkeypatch):
    with_hub = discover_models()
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    assert discover_models() == with_hub


def test_cli_json_lists_every_row(machine, capsys):
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed == json.loads(json.dumps([r.to_dict() for r in discover_models()]))
    assert {"source", "name", "path", "format", "family", "total_params", "active_params",
            "dtype", "size", "supported", "reason", "config_only", "fits"} == set(listed[0])


def test_cli_table_is_aligned_and_says_why(machine, models, tmp_path, capsys):
    shutil.copytree(models["llama"], tmp_path / "mine" / "llama")
    assert main(["models", "--folder", str(tmp_path / "mine")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines[0]
    table = lines[1:1 + len(discover_models([tmp_path / "mine"]))]
    starts = [header.index(col) for col in ("SOURCE", "FAMILY", "PARAMS", "SIZE", "FULL")]
    for line in table:  # every column starts where its heading does
        assert all(line[s - 1] == " " and line[s] != " " for s in starts), line
    assert any(line.startswith("org/tiny-llama ") for line in table)
    assert "state-spaces/mamba: " in out and "model_type 'mamba' is not supported" in out


def test_with_no_memory_to_budget_the_models_are_listed_unplanned(machine, monkeypatch):
    full = HostMemory(total=4 * GiB, available=GiB, own=0)  # less than the 2 GiB margin
    monkeypatch.setattr(planner, "host_memory", lambda: full)
    row = _rows()["hf-cache", "org/tiny-llama"]
    assert row.supported and [f.verdict for f in row.fits] == [None] * 3
    assert all("budget.ram: leaves nothing" in f.reason for f in row.fits)
