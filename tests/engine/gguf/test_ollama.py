"""Handing an export to Ollama: ``ollama create`` with a fake ``ollama`` on PATH that records its
arguments, the how-to without one, and one clear message for each bad input."""
from __future__ import annotations

from pathlib import Path

import pytest

from slideformer.engine.api import UserError, ollama_model_name, send_to_ollama
from slideformer.engine.cli import main
from slideformer.engine.models.tiny import TinyShape


def export(tmp_path: Path, name: str = "m-bf16") -> Path:
    """A GGUF file and its Modelfile, as export-gguf leaves them (the GGUF's bytes do not matter
    to a fake ollama)."""
    (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    (tmp_path / f"{name}.Modelfile").write_text(f"FROM ./{name}.gguf\n")
    return tmp_path / f"{name}.gguf"


def test_send_runs_ollama_create_on_the_modelfile(tmp_path, fake_ollama):
    record = fake_ollama()
    gguf = export(tmp_path)
    for given in (gguf, gguf.with_suffix(".Modelfile")):
        result = send_to_ollama(given, "my-model:ft")
        assert result.created and result.modelfile == gguf.with_suffix(".Modelfile").resolve()
        assert record.read_text().splitlines() == ["create", "my-model:ft", "-f",
                                                   str(result.modelfile)]
        assert result.message == "Ollama model my-model:ft created: ollama run my-model:ft"


def test_without_ollama_it_says_how(tmp_path, fake_ollama):
    fake_ollama(None)
    folder = tmp_path / "my runs"  # the command to paste quotes the path
    folder.mkdir()
    result = send_to_ollama(export(folder), "mine")
    assert not result.created
    assert f"ollama create mine -f '{folder.resolve()}/m-bf16.Modelfile'" in result.message
    assert "ollama.com/download" in result.message and "ollama run mine" in result.message


def test_ollama_failing_is_one_clear_message(tmp_path, fake_ollama):
    fake_ollama('echo "Error: could not connect to ollama app, is it running?" >&2\nexit 1')
    gguf = export(tmp_path)
    with pytest.raises(UserError) as e:
        send_to_ollama(gguf, "mine")
    assert e.value.where == str(gguf.with_suffix(".Modelfile").resolve())
    assert "exit code 1" in e.value.problem and "could not connect to ollama app" in e.value.problem
    assert "Error:" not in e.value.problem
    assert e.value.fix.startswith("start Ollama") and "ollama create mine -f" in e.value.fix


def test_bad_inputs_name_the_file_and_the_fix(tmp_path, fake_ollama):
    fake_ollama(None)
    with pytest.raises(UserError, match=r"none\.gguf: does not exist\n  fix: export the model"):
        send_to_ollama(tmp_path / "none.gguf", "mine")
    lone = tmp_path / "lone.gguf"
    lone.write_bytes(b"GGUF")
    with pytest.raises(UserError, match=r"lone\.Modelfile: is missing .*\n  fix: export"):
        send_to_ollama(lone, "mine")
    orphan = tmp_path / "orphan.Modelfile"
    orphan.write_text("# a comment\nFROM ./gone.gguf\n")
    with pytest.raises(UserError, match=r"gone\.gguf: does not exist \(the GGUF that orphan"):
        send_to_ollama(orphan, "mine")
    with pytest.raises(UserError, match="not a name Ollama accepts"):
        send_to_ollama(export(tmp_path), "no spaces allowed")
    registry = tmp_path / "registry.Modelfile"  # FROM a model name, not a file: Ollama's business
    registry.write_text("FROM llama3.2\n")
    assert not send_to_ollama(registry, "mine").created


def test_default_name():
    assert ollama_model_name("out/SmolLM2-135M-Instruct-ft-bf16.gguf") == \
        "smollm2-135m-instruct-ft-bf16"
    assert ollama_model_name("Ünï cødé!.gguf") == "n-c-d"


def test_cli_export_then_ollama(tiny_model_factory, tmp_path, fake_ollama, capsys):
    src = tiny_model_factory("llama", TinyShape(layers=2), seed=3)
    out = tmp_path / "t.gguf"
    assert main(["export-gguf", str(src), "--type", "q8_0", "--out", str(out),
                 "--ollama", "bad name"]) == 2
    assert "not a name Ollama accepts" in capsys.readouterr().err and not out.exists()
    record = fake_ollama()
    assert main(["export-gguf", str(src), "--type", "q8_0", "--out", str(out),
                 "--ollama", "tiny"]) == 0
    assert record.read_text().splitlines() == ["create", "tiny", "-f",
                                               str(out.with_suffix(".Modelfile").resolve())]
    printed = capsys.readouterr().out
    assert f"created {out}" in printed and "Ollama model tiny created" in printed
