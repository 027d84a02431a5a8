"""The models already on this machine, each with what it is and what training it fits.

:func:`discover_models` lists the stores of :mod:`slideformer.engine.models.stores` (the
Hugging Face cache, Ollama, LM Studio, the folders given) and reads each find without loading a
weight: a model folder through its config.json (:func:`~slideformer.engine.models.spec.load_spec`),
a GGUF file through its header (:func:`~slideformer.engine.gguf.header.read_header`) and the
checks import makes before it reads a tensor. Each becomes a :class:`FoundModel`; a model the
engine cannot train, or a broken one, becomes a row with ``supported=False`` and the engine's
message, never an exception.

Each supported model is planned for full fine-tuning, LoRA and QLoRA on this machine with the
run defaults (:class:`~slideformer.engine.config.RunConfig`: sequences of 1024 tokens,
micro-batch 1) and the memory it has free: the planner's verdict and reason, as
``slideformer plan`` words them (:func:`~slideformer.engine.plan.planner.fit_verdict`). A GGUF is
planned as the bf16 folder import makes of it, which is what trains.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slideformer.engine.config import METHODS, RunConfig, override
from slideformer.engine.errors import UserError, path_error
from slideformer.engine.models.spec import ModelSpec, load_config, spec_from_config
from slideformer.engine.models.stores import SOURCES, Candidate, Roots, candidates, default_roots

if TYPE_CHECKING:  # the planner imports torch: imported when a scan runs
    from slideformer.engine.plan.planner import Machine


@dataclass(frozen=True)
class Fit:
    """The planner's answer for one training method."""
    method: str
    """full, lora or qlora."""
    verdict: str | None
    """fits, tight or does not fit; None: the planner could not plan it (see reason)."""
    reason: str
    """The planner's one line ("fits with 18.5 GiB of host RAM to spare on ..."), or its error."""


@dataclass(frozen=True)
class FoundModel:
    """One model on this machine (a row of ``slideformer models``, JSON-ready by :meth:`to_dict`)."""
    source: str
    """hf-cache, ollama, lm-studio or folder."""
    name: str
    """As its store names it: ``org/name``, ``llama3.2:3b``, a folder or file name."""
    path: str
    """The model folder, or the GGUF file (what the Model page opens or imports)."""
    format: str
    """hf (a Hugging Face folder) or gguf."""
    family: str | None
    """``model_type`` (a GGUF: of the folder import makes, else its architecture); None when
    unreadable."""
    total_params: int | None
    active_params: int | None
    """Parameters a token computes with (a mixture of experts: its routed experts only)."""
    dtype: str | None
    """config.json's ``torch_dtype``, or a GGUF's dominant tensor type (most weights: Q4_K)."""
    size: int
    """Bytes on disk."""
    supported: bool
    reason: str
    """Why it cannot be trained (the engine's message); "" when supported."""
    config_only: bool
    """A model folder without its weights (``*.safetensors``) yet: it can be planned only."""
    fits: tuple[Fit, ...]
    """Full, LoRA and QLoRA on this machine; empty when not supported."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def discover_models(folders=(), roots: Roots | None = None) -> list[FoundModel]:
    """Every model of this machine's stores and of ``folders``, store by store, by name.

    Args:
        folders: more folders to search (each a model folder, or searched 2 levels deep).
        roots: where the stores are; None: this machine's (stores.default_roots).
    """
    from slideformer.engine.plan.planner import resolve_machine  # imports torch

    try:
        machine = resolve_machine(RunConfig(), "this")
    except UserError as e:  # no memory left to budget, a broken profile: listed, not planned
        machine = e
    planned: dict[str, tuple[Fit, ...]] = {}  # by config.json: Ollama's tags share their blob
    rows = []
    for c in candidates(roots or default_roots(), folders):
        facts = _facts(c)
        fits = ()
        if facts.spec is not None:
            key = json.dumps(facts.spec.raw_config, sort_keys=True, default=str)
            if key not in planned:
                planned[key] = tuple(_fit(m, facts.spec, machine) for m in METHODS)
            fits = planned[key]
        rows.append(_row(c, facts, fits))
    order = {s: i for i, s in enumerate(SOURCES)}
    return sorted(rows, key=lambda r: (order[r.source], r.name.casefold(), r.path))


def _fit(method: str, spec: ModelSpec, machine: Machine | UserError) -> Fit:
    from slideformer.engine.plan.planner import fit_verdict
    if isinstance(machine, UserError):
        return Fit(method, None, str(machine))
    try:
        verdict, reason = fit_verdict(_method_config(method), spec, machine)
    except (UserError, ValueError) as e:  # ValueError: a shape QLoRA's NF4 blocks do not tile
        return Fit(method, None, str(e))
    return Fit(method, verdict, reason)


@functools.cache
def _method_config(method: str) -> RunConfig:
    return override(RunConfig(), {"train.method": method})


def _row(c: Candidate, f: _Facts, fits: tuple[Fit, ...]) -> FoundModel:
    s = f.spec
    return FoundModel(source=c.source, name=c.name, path=str(c.path), format=c.format,
                      family=f.family, total_params=s.num_params if s else None,
                      active_params=s.active_params if s else None, dtype=f.dtype, size=c.size,
                      supported=s is not None, reason=f.error, config_only=f.config_only,
                      fits=fits)


# ---- reading one find ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Facts:
    """What reading a find says, before any plan."""
    family: str | None
    spec: ModelSpec | None
    """None: it cannot be trained (see error)."""
    dtype: str | None = None
    config_only: bool = False
    error: str = ""


def _facts(c: Candidate) -> _Facts:
    if c.problem is not None:
        return _Facts(None, None, error=str(c.problem))
    if c.format == "hf":
        return _folder_facts(c.path)
    try:
        st = c.path.stat()
    except OSError as e:
        return _Facts(None, None, error=str(path_error(e)))
    return _gguf_facts(c.path, st.st_size, st.st_mtime_ns)


def _folder_facts(folder: Path) -> _Facts:
    family = None
    try:
        cfg = load_config(folder)
        family = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None
        spec = spec_from_config(cfg, folder / "config.json")
        return _Facts(family, spec, spec.torch_dtype, _config_only(folder))
    except UserError as e:
        return _Facts(family, None, error=str(e))
    except OSError as e:
        return _Facts(family, None, error=str(path_error(e)))


def _config_only(folder: Path) -> bool:
    """No ``*.safetensors`` yet; pickle weights instead are refused in the engine's words."""
    if any(folder.glob("*.safetensors")):
        return False
    if any(p.suffix in (".bin", ".pt", ".pth") for p in folder.iterdir()):
        from slideformer.engine.models.weights import Checkpoint
        Checkpoint(folder)  # raises: no safetensors weights, and why pickles are not loaded
    return True


@functools.lru_cache(maxsize=1024)
def _gguf_facts(path: Path, size: int, mtime_ns: int) -> _Facts:
    """A GGUF file's facts, kept while its size and time stay the same: a rescan reads no
    header twice (SmolLM2-135M's takes 12 ms, and 18 ms more for the import checks)."""
    from slideformer.engine.gguf.header import read_header
    from slideformer.engine.gguf.importer import importable
    family = None
    try:
        header = read_header(path)
        arch = header.get("general.architecture")
        family = arch if isinstance(arch, str) else None
        spec = importable(header)
    except UserError as e:
        return _Facts(family, None, error=str(e))
    weights = Counter()
    for t in header.tensors.values():
        weights[t.tensor_type.name] += t.n_elements
    return _Facts(spec.model_type, spec, weights.most_common(1)[0][0])
