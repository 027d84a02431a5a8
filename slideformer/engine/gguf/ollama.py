"""Hand an exported GGUF to Ollama: ``ollama create NAME -f FILE.Modelfile``.

``slideformer export-gguf`` writes ``NAME-TYPE.gguf`` and ``NAME-TYPE.Modelfile`` side by side;
:func:`send_to_ollama` runs ``ollama create`` on that Modelfile when ``ollama`` is on PATH (the
Ollama server copies the GGUF into its own store, so the files may be moved afterwards), and
otherwise returns the command to run by hand. Ollama's own failures (its server not running, a
bad Modelfile) become one :class:`UserError` with Ollama's message.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.errors import UserError

DOWNLOAD = "https://ollama.com/download"
TIMEOUT_S = 3600.0
"""``ollama create`` copies the GGUF into Ollama's store: about a minute for 8 GB on an SSD."""
_NAME = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_-]{0,79}/)?[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}"
                   r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,79})?")
"""[namespace/]model[:tag], each part as Ollama's model names allow."""
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass(frozen=True)
class OllamaResult:
    """What :func:`send_to_ollama` did."""

    name: str
    modelfile: Path
    command: tuple[str, ...]
    """``ollama create NAME -f MODELFILE``: what ran, or what to run by hand."""
    created: bool
    """False: ``ollama`` is not on PATH, nothing ran; :attr:`message` says what to do."""

    @property
    def message(self) -> str:
        if self.created:
            return f"Ollama model {self.name} created: ollama run {self.name}"
        return (f"Ollama is not installed here (no `ollama` on PATH). Install it from {DOWNLOAD}, "
                f"then run:\n  {command_line(self.command)}\n  ollama run {self.name}")


def default_name(gguf_file: Path | str) -> str:
    """An Ollama model name from a GGUF file's name (``SmolLM2-135M-Instruct-bf16.gguf`` ->
    ``smollm2-135m-instruct-bf16``)."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", Path(gguf_file).stem.lower()).strip("-.")
    return (name or "model")[:80]


def send_to_ollama(path: Path | str, name: str, timeout: float = TIMEOUT_S) -> OllamaResult:
    """Create the Ollama model ``name`` from an exported GGUF file or its Modelfile.

    Raises:
        UserError: no GGUF or Modelfile there, a name Ollama refuses, or ``ollama create``
            failed (with Ollama's message and what to do).
    """
    check_name(name)
    modelfile = modelfile_for(Path(path))
    command = ("ollama", "create", name, "-f", str(modelfile))
    exe = shutil.which("ollama")
    if exe is None:
        return OllamaResult(name, modelfile, command, created=False)
    try:
        done = subprocess.run([exe, *command[1:]], capture_output=True, text=True,
                              errors="replace", timeout=timeout, stdin=subprocess.DEVNULL,
                              cwd=modelfile.parent)
    except subprocess.TimeoutExpired:
        raise UserError(modelfile, f"`ollama create` did not finish in {timeout / 60:.0f} min",
                        "check that the Ollama server answers (ollama list), then run: "
                        + command_line(command)) from None
    except OSError as e:
        raise UserError(exe, f"cannot be run ({e.strerror or e})",
                        f"reinstall Ollama ({DOWNLOAD})") from None
    if done.returncode != 0:
        said = _last_line(done.stderr) or _last_line(done.stdout) or "no message"
        fix = ("start Ollama (the Ollama app, or `ollama serve` in a terminal), then run: "
               if "connect" in said.lower() else "fix what Ollama says, then run: ")
        raise UserError(modelfile, f"`ollama create` failed (exit code {done.returncode}): {said}",
                        fix + command_line(command))
    return OllamaResult(name, modelfile, command, created=True)


def check_name(name: str) -> None:
    """Refuse a model name that Ollama would refuse, before any work is done."""
    if not _NAME.fullmatch(name):
        raise UserError(f"Ollama model name {name!r}", "is not a name Ollama accepts",
                        "use letters, digits, '-', '_' and '.', optionally with a tag "
                        "(my-model:q8)")


def modelfile_for(path: Path) -> Path:
    """The Modelfile of an exported GGUF (``X.gguf`` -> ``X.Modelfile``), or ``path`` itself
    when it is a Modelfile; its GGUF must be where its ``FROM`` line says."""
    path = path.expanduser().resolve()
    export = "export the model again: slideformer export-gguf MODEL_FOLDER (it writes both files)"
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise UserError(path, "does not exist", export)
        modelfile = path.with_suffix(".Modelfile")
        if not modelfile.is_file():
            raise UserError(modelfile, f"is missing (the Modelfile of {path.name})", export)
        return modelfile
    if not path.is_file():
        raise UserError(path, "does not exist", "give the .gguf file or the .Modelfile "
                        "that slideformer export-gguf wrote")
    source = _from_file(path)
    if source is None:
        raise UserError(path, "is not a Modelfile (it has no FROM line)",
                        "give the .gguf file or the .Modelfile that slideformer export-gguf wrote")
    if isinstance(source, Path) and not source.is_file():
        raise UserError(source, f"does not exist (the GGUF that {path.name} is FROM)",
                        f"move the GGUF back next to {path.name}, or {export}")
    return path


def _from_file(modelfile: Path) -> Path | str | None:
    """The local file a Modelfile's FROM line names, the model name it names instead
    (``FROM llama3.2``), or None when it has no FROM line."""
    try:
        text = modelfile.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UserError(modelfile, f"cannot be read ({e.strerror or e})",
                        "check the file's permissions") from None
    for line in text.splitlines():
        keyword, _, value = line.strip().partition(" ")
        value = value.strip().strip('"')
        if keyword.upper() == "FROM" and value:
            if value.startswith((".", "/", "~")) or value.lower().endswith(".gguf"):
                return (modelfile.parent / Path(value).expanduser()).resolve()
            return value
    return None


def _last_line(text: str) -> str:
    """Ollama's message: the last line it printed, without progress spinners or 'Error: '."""
    lines = [ln.strip() for ln in _ANSI.sub("", text or "").replace("\r", "\n").splitlines()]
    last = next((ln for ln in reversed(lines) if ln), "")
    return last.removeprefix("Error: ")


def command_line(args: tuple[str, ...] | list[str]) -> str:
    """``args`` as one line to paste into this system's shell."""
    return subprocess.list2cmdline(list(args)) if os.name == "nt" else shlex.join(args)
