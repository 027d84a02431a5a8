"""Where models already live on a machine, and what is found there (nothing is read yet).

- The Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
  ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``, as huggingface_hub
  resolves it): each model repo's newest snapshot folder, ``models--<org>--<name>/snapshots/<commit>/``.
- Ollama's store (``OLLAMA_MODELS``, else ``~/.ollama/models`` and the Linux service's
  ``/usr/share/ollama/.ollama/models``): each ``manifests/<registry>/<namespace>/<model>/<tag>``
  names its model layer's blob, ``blobs/sha256-<hex>``, a GGUF file.
- LM Studio's models folders (``~/.lmstudio/models``, and the older ``~/.cache/lm-studio/models``),
  ``<publisher>/<repo>/*.gguf``, and the folders the user adds: each searched like a folder
  the user adds (:func:`folder_models`).

Each find is a :class:`Candidate`: a model folder (config.json) or a GGUF file, its size on
disk, or the problem that makes it unusable before anything is read (a cache entry missing its
blobs, a manifest naming a blob that is not there).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.errors import UserError, path_error
from slideformer.engine.jsonfile import read_json

SOURCES = ("hf-cache", "ollama", "lm-studio", "folder")
"""Where a model was found, in the order rows are listed."""
FOLDER_DEPTH = 2
"""Levels of subfolders searched below a folder that is not a model folder itself."""
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
"""A split GGUF's part (llama.cpp's gguf-split names): only part 1 has the metadata."""


@dataclass(frozen=True)
class Roots:
    """Where a scan looks (besides the folders the user adds)."""
    hf_cache: Path
    ollama: tuple[Path, ...]
    lm_studio: tuple[Path, ...]


def default_roots() -> Roots:
    """This machine's stores, from the environment (see the module docstring)."""
    env, home = os.environ, Path.home()
    hf_home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or home / ".cache")
                   / "huggingface")
    ollama = ((Path(env["OLLAMA_MODELS"]),) if env.get("OLLAMA_MODELS") else
              (home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")))
    return Roots(hf_cache=Path(env.get("HF_HUB_CACHE") or hf_home / "hub"), ollama=ollama,
                 lm_studio=(home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"))


@dataclass(frozen=True)
class Candidate:
    """A model found in a store, not read yet."""
    source: str
    """One of :data:`SOURCES`."""
    name: str
    path: Path
    """The model folder (format hf) or the GGUF file (format gguf)."""
    format: str
    """hf or gguf."""
    size: int
    """Bytes on disk (every file of the folder; every part of a split GGUF)."""
    problem: UserError | None = None
    """Why it cannot be used, when that is known before reading it."""


def candidates(roots: Roots, folders=()) -> list[Candidate]:
    """Every model of the stores in ``roots`` and of ``folders``, store by store."""
    found = hf_cache_models(roots.hf_cache)
    for root in roots.ollama:
        found += ollama_models(root)
    for root in roots.lm_studio:
        if root.is_dir():
            found += folder_models(root, "lm-studio")
    for folder in folders:
        found += folder_models(Path(folder), "folder")
    return found


# ---- the Hugging Face hub cache ------------------------------------------------------------------
def hf_cache_models(cache: Path) -> list[Candidate]:
    """The newest snapshot of each model repo of the hub cache ``cache``.

    The cache is read with ``huggingface_hub.scan_cache_dir`` where that package is installed:
    it comes with transformers, but slideformer does not depend on it, so without it the same
    layout is walked here (:func:`_walk_hub_cache`: the same snapshots, sizes and newest
    revision; only a broken entry's message differs).
    """
    if not cache.is_dir():
        return []
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:
        snapshots = _walk_hub_cache(cache)
    else:
        snapshots = _scan_hub_cache(scan_cache_dir, cache)
    found = []
    for repo_id, snapshot, size, problem in snapshots:
        if problem is not None:
            found.append(Candidate("hf-cache", repo_id, snapshot, "hf", size, problem))
        else:
            found += _snapshot_models(repo_id, snapshot, size)
    return found


def _scan_hub_cache(scan_cache_dir, cache: Path):
    info = scan_cache_dir(cache)
    for repo in info.repos:
        if repo.repo_type == "model" and repo.revisions:
            rev = max(repo.revisions, key=lambda r: r.last_modified)
            yield repo.repo_id, rev.snapshot_path, rev.size_on_disk, None
    for warning in info.warnings:  # a repo huggingface_hub could not read, named in its text
        folder = re.search(r"models--[^/\\\s]+", str(warning))
        if folder is not None:
            repo = cache.resolve() / folder.group()
            yield _repo_id(repo), repo, 0, _broken_repo(repo, str(warning))


def _walk_hub_cache(cache: Path):
    for repo in sorted(cache.resolve().glob("models--*")):
        snaps = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
        if not snaps:
            yield _repo_id(repo), repo, 0, _broken_repo(repo, "it has no snapshot")
            continue
        try:
            trees = [(_tree(s), s) for s in snaps]
        except UserError as e:
            yield _repo_id(repo), repo, 0, e
            continue
        (size, _), snapshot = max(trees, key=lambda t: t[0][1])
        yield _repo_id(repo), snapshot, size, None


def _repo_id(repo: Path) -> str:
    """``models--org--name`` -> ``org/name``."""
    return repo.name.removeprefix("models--").replace("--", "/")


def _broken_repo(repo: Path, why: str) -> UserError:
    return UserError(repo, f"is not a complete Hugging Face cache entry ({why})",
                     f"download the model again (hf download {_repo_id(repo)}), or delete "
                     "the folder")


def _snapshot_models(repo_id: str, snapshot: Path, size: int) -> list[Candidate]:
    """A snapshot's model folder (its config.json), or its GGUF files; a snapshot with neither
    is still listed as a folder (reading it says what is missing)."""
    ggufs = gguf_files(snapshot, recursive=True)
    found = [Candidate("hf-cache", repo_id, snapshot, "hf", size)] \
        if (snapshot / "config.json").exists() or not ggufs else []
    return found + [Candidate("hf-cache", f"{repo_id}/{f.stem}", f, "gguf", n) for f, n in ggufs]


# ---- Ollama --------------------------------------------------------------------------------------
def ollama_models(root: Path) -> list[Candidate]:
    """One GGUF per tag of Ollama's store ``root`` (tags of one model may share a blob)."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    found = []
    for tag in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
        registry, namespace, model, label = tag.relative_to(manifests).parts
        path = "/".join(p for p in (registry, namespace) if p not in ("registry.ollama.ai", "library"))
        name = f"{path}/{model}:{label}" if path else f"{model}:{label}"
        try:
            blob = _ollama_blob(root, tag, name)
        except UserError as e:
            found.append(Candidate("ollama", name, tag, "gguf", 0, e))
            continue
        found.append(Candidate("ollama", name, blob, "gguf", blob.stat().st_size))
    return found


def _ollama_blob(root: Path, tag: Path, name: str) -> Path:
    """The model blob a manifest names."""
    fix = f"pull the model again (ollama pull {name})"
    manifest = read_json(tag, fix)
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    digests = [layer.get("digest") for layer in layers or ()
               if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if not digests or not isinstance(digests[0], str) or not digests[0].startswith("sha256:"):
        raise UserError(tag, f"names no model layer ({OLLAMA_MODEL_LAYER} with a sha256 digest)",
                        fix)
    blob = root / "blobs" / digests[0].replace(":", "-", 1)
    if not blob.is_file():
        raise UserError(blob, f"is missing (the model layer of {tag})", fix)
    return blob


# ---- folders -------------------------------------------------------------------------------------
def folder_models(root: Path, source: str) -> list[Candidate]:
    """The models of a folder: itself if it holds config.json, else its model folders and GGUF
    files down to :data:`FOLDER_DEPTH` levels of subfolders (hidden ones skipped)."""
    if not root.is_dir():
        problem = UserError(root, "is not a folder", "reconnect its drive, or stop searching it")
        return [Candidate(source, root.name, root, "hf", 0, problem)]
    return list(_search(root, root, source, FOLDER_DEPTH))


def _search(root: Path, folder: Path, source: str, depth: int):
    name = folder.relative_to(root).as_posix() if folder != root else folder.name
    try:
        if (folder / "config.json").is_file():
            yield Candidate(source, name, folder, "hf", _tree(folder)[0])
        for f, size in gguf_files(folder, recursive=False):
            yield Candidate(source, f.stem, f, "gguf", size)
        if depth and not (folder / "config.json").is_file():
            for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
                yield from _search(root, sub, source, depth - 1)
    except UserError as e:  # a broken link in a model folder
        yield Candidate(source, name, folder, "hf", 0, e)
    except OSError as e:  # a folder this user may not list
        yield Candidate(source, name, folder, "hf", 0, path_error(e))


def gguf_files(folder: Path, recursive: bool) -> list[tuple[Path, int]]:
    """(file, bytes on disk) of the GGUF models in ``folder``: a split model once (its first
    part, the size of all parts); vision projectors (``mmproj*``) are not models."""
    found = []
    for f in sorted(folder.rglob("*.gguf") if recursive else folder.glob("*.gguf")):
        split = _SPLIT.search(f.name)
        if f.name.startswith("mmproj") or (split and split.group(1) != "00001"):
            continue
        parts = sorted(f.parent.glob(f"{f.name[:split.start()]}-*-of-{split.group(2)}.gguf")) \
            if split else [f]
        found.append((f, sum(p.stat().st_size for p in parts)))
    return found


def _tree(folder: Path) -> tuple[int, float]:
    """(bytes, newest modification time) of the files below ``folder``, links followed and each
    file counted once (a hub snapshot links to shared blobs)."""
    seen: dict[Path, os.stat_result] = {}
    for f in folder.rglob("*"):
        if f.is_dir():
            continue
        target = f.resolve()
        if not target.exists():
            raise UserError(f, "is a link to a file that is missing", "download the model again")
        seen.setdefault(target, target.stat())
    if not seen:
        return 0, folder.stat().st_mtime
    return sum(s.st_size for s in seen.values()), max(s.st_mtime for s in seen.values())
