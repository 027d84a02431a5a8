"""The ``slideformer`` CLI: version, help, make-tiny-model + info, one clear error per bad input."""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slideformer.engine import __version__
from slideformer.engine.cli import main
from slideformer.engine.models.spec import SUPPORTED, load_spec
from slideformer.engine.models.weights import write_hf_folder

REPO = Path(__file__).parents[3]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """slideformer.engine.cli.main in-process: (exit code, stdout, stderr)."""
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's --help / --version / usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---- version, help -----------------------------------------------------------------------------
def test_version():
    r = subprocess.run([sys.executable, "-m", "slideformer.engine.cli", "--version"], cwd=REPO,
                       capture_output=True, text=True)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, f"slideformer {__version__}", "")


def test_help_lists_commands(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and out.startswith("usage: slideformer")
    for command in ("make-tiny-model", "info"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), command  # listed with its help


# ---- make-tiny-model + info --------------------------------------------------------------------
@pytest.mark.parametrize("arch,flags", [(a, ()) for a in SUPPORTED] + [
    ("llama", ("--tie",)), ("qwen3", ("--head-dim", "24", "--layers", "3"))])
def test_tiny_model_info_counts_parameters(arch, flags, tmp_path, capsys, load_hf):
    out = tmp_path / "model"
    rc, text, _ = run(capsys, "make-tiny-model", "--arch", arch, "--out", str(out), *flags)
    assert rc == 0 and str(out) in text
    rc, text, err = run(capsys, "info", str(out), "--json")
    assert (rc, err) == (0, "")
    report = json.loads(text)
    ref = load_hf(out)  # parameters() counts a tied embedding once, as we do
    assert report["parameters"] == sum(p.numel() for p in ref.parameters())
    assert report["family"] == arch and report["chat_template"] is True
    assert report["tied_embeddings"] == ("--tie" in flags)
    assert report["weights_dtype"] == "F32"
    assert report["size_on_disk"] == (out / "model.safetensors").stat().st_size


def test_info_text_output(tiny_model, capsys):
    rc, out, _ = run(capsys, "info", str(tiny_model))
    spec = load_spec(tiny_model)
    assert rc == 0 and re.search(rf"parameters: {spec.num_params:,}$", out, re.M)


def test_make_tiny_model_refuses_non_empty_folder(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    rc, _, err = run(capsys, "make-tiny-model", "--out", str(tmp_path))
    assert rc == 2 and "exists and is not empty" in err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


# ---- bad model folders: one clear message each -------------------------------------------------
def edit_json(path: Path, **changes) -> None:
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            del cfg[k]
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def header_of(path: Path, header: dict) -> None:
    """Replace a safetensors file by one with ``header`` (and no data)."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


UP1 = "model.layers.1.mlp.up_proj.weight"
SHARD2 = "model-00002-of-00004.safetensors"
# (id, break the folder, file the message must name, what it must say)
BAD_FOLDERS = [
    ("missing-config", lambda d: (d / "config.json").unlink(),
     "config.json", r"is missing"),
    ("config-not-json", lambda d: (d / "config.json").write_text('{"model_type": "llama",'),
     "config.json", r"is not valid JSON"),
    ("config-not-object", lambda d: (d / "config.json").write_text("[1, 2]"),
     "config.json", r"is not a JSON object"),
    ("unknown-model-type", lambda d: edit_json(d / "config.json", model_type="gpt2"),
     "config.json", r"model_type 'gpt2' is not supported.*llama, mistral, qwen2, qwen3"),
    ("config-missing-key", lambda d: edit_json(d / "config.json", vocab_size=...),
     "config.json", r"has no 'vocab_size'"),
    ("config-null-size", lambda d: edit_json(d / "config.json", hidden_size=None),
     "config.json", r"'hidden_size' is None, not a positive integer"),
    ("heads-not-multiple", lambda d: edit_json(d / "config.json", num_key_value_heads=4),
     "config.json", r"num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
    ("rope-unknown-type", lambda d: edit_json(
        d / "config.json", rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
     "config.json", r"rope_scaling type 'dynamic' is not supported"),
    ("longrope-no-factors", lambda d: edit_json(
        d / "config.json", rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     "config.json", r"rope_scaling.short_factor is None, not a list of positive numbers"),
    ("longrope-factors-too-few", lambda d: edit_json(
        d / "config.json", rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3,
                                         "long_factor": [2.0] * 3}),
     "config.json", r"rope_scaling.short_factor has 3 numbers, but RoPE turns 8 pairs"),
    ("yarn-incomplete", lambda d: edit_json(
        d / "config.json", rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}),
     "config.json", r"lacks a positive original_max_position_embeddings, beta_fast"),
    ("rope-incomplete", lambda d: edit_json(
        d / "config.json", rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "config.json", r"lacks a positive low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ("no-safetensors", lambda d: [p.rename(p.with_name("pytorch_model.bin"))
                                  for p in d.glob("*.safetensors")],
     ".", r"has no \*\.safetensors weights.*pickle"),
    ("index-not-json", lambda d: (d / "model.safetensors.index.json").write_text("{"),
     "model.safetensors.index.json", r"is not valid JSON"),
    ("shard-missing", lambda d: (d / SHARD2).unlink(),
     SHARD2, r"is named in model\.safetensors\.index\.json but missing"),
    ("header-truncated-file", lambda d: (d / SHARD2).write_bytes(b"\x10\x00"),
     SHARD2, r"is truncated \(no safetensors header\)"),
    ("header-bad-length", lambda d: patch_bytes(d / SHARD2, 0, struct.pack("<Q", 1 << 40)),
     SHARD2, r"corrupt safetensors header \(bad length\)"),
    ("header-not-json", lambda d: patch_bytes(d / SHARD2, 8, b"\x00garbage"),
     SHARD2, r"corrupt safetensors header \(is not valid JSON"),
    ("header-bad-entries", lambda d: header_of(d / SHARD2, {UP1: {"dtype": "F32"}}),
     SHARD2, r"corrupt safetensors header \(bad tensor entries\)"),
    ("data-truncated", lambda d: (d / SHARD2).write_bytes((d / SHARD2).read_bytes()[:-100]),
     SHARD2, r"is truncated \(\d+ bytes, header needs \d+\)"),
    ("tensor-wrong-shape", lambda d: edit_tensors(
        d / "model.safetensors", lambda t: t.update({UP1: t[UP1][:-1]})),
     "model.safetensors",
     rf"tensor '{UP1}' has shape \[159, 96\], config\.json implies \[160, 96\]"),
    ("tensor-missing", lambda d: edit_tensors(d / "model.safetensors", lambda t: t.pop(UP1)),
     ".", rf"tensor '{UP1}' is missing from the safetensors files"),
    ("missing-tokenizer", lambda d: (d / "tokenizer.json").unlink(),
     "tokenizer.json", r"is missing"),
    ("tokenizer-corrupt", lambda d: (d / "tokenizer.json").write_text('{"version": "1.0"}'),
     "tokenizer.json", r"cannot be read"),
    ("tokenizer-config-not-json", lambda d: (d / "tokenizer_config.json").write_text("{"),
     "tokenizer_config.json", r"is not valid JSON"),
]
SHARDED = {"shard-missing", "index-not-json", "header-truncated-file", "header-bad-length",
           "header-not-json", "header-bad-entries", "data-truncated"}


@pytest.fixture(scope="module")
def sharded_tiny(tiny_model_factory, tmp_path_factory):
    """The tiny llama re-written as 4 shards + index."""
    src = tiny_model_factory("llama")
    tensors = load_file(src / "model.safetensors")
    out = write_hf_folder(tmp_path_factory.mktemp("sharded") / "model", load_spec(src),
                          tensors.items(), dtype=torch.float32, max_shard_bytes=400 << 10,
                          tokenizer_dir=src)
    assert (out / "model-00004-of-00004.safetensors").is_file()
    return out


@pytest.mark.parametrize("case,breaker,where,problem",
                         [pytest.param(*c, id=c[0]) for c in BAD_FOLDERS])
def test_info_reports_bad_folder(case, breaker, where, problem, tiny_model_factory, sharded_tiny,
                                 tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(sharded_tiny if case in SHARDED else tiny_model_factory("llama"), folder)
    breaker(folder)
    rc, out, err = run(capsys, "info", str(folder))
    assert (rc, out) == (2, "")
    lines = err.splitlines()
    assert len(lines) == 2, err  # one message: "error: <file>: <problem>" and "  fix: <fix>"
    assert lines[0].startswith(f"error: {folder / where}: ")  # where = "." names the folder
    assert re.search(problem, err, re.S), err
    assert re.fullmatch(r"  fix: \S.{10,}", lines[1]), err


def test_info_missing_folder(tmp_path, capsys):
    rc, _, err = run(capsys, "info", str(tmp_path / "nope"))
    assert rc == 2 and err.startswith(f"error: {tmp_path / 'nope'}: is not a folder")


def test_info_error_in_a_real_process(tmp_path):
    """The installed entry point's path: exit code 2, the message, no traceback."""
    r = subprocess.run([sys.executable, "-m", "slideformer.engine.cli", "info", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"error: {tmp_path / 'config.json'}: is missing\n  fix: ")
    assert "Traceback" not in r.stderr
