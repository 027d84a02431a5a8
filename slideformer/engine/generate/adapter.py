"""A LoRA adapter folder (what a LoRA run writes as ``final/``), read back and checked against its
base model: chat runs the base with ``s * B @ A`` added to each adapted matrix as its layer is
read, and GGUF export converts the same tensors (:mod:`slideformer.engine.gguf.lora_adapter`).

PEFT's folder is ``adapter_config.json`` (LoraConfig's fields) and ``adapter_model.safetensors``
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``: A of shape (r, in), B of
(out, r)). Only plain LoRA is read: a setting that changes what the adapter computes (DoRA's
magnitudes, trained biases, per-module ranks or alphas, fully trained modules, transposed
weights) or another PEFT method is refused, never approximated by the plain formula. Every
tensor the config implies must be there with its shape, finite, and nothing else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from slideformer.engine.errors import UserError
from slideformer.engine.jsonfile import lone_surrogate, read_json
from slideformer.engine.models.lora import PROJECTIONS, LoraSpec, adaptable, layer_targets
from slideformer.engine.models.spec import ModelSpec, load_spec
from slideformer.engine.models.weights import hf_name
from slideformer.engine.train.lora_export import PEFT_PREFIX

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_RANK = 2**16
"""A rank far above any real adapter's (they are 4-256)."""
MAX_ALPHA = 1e6
"""An alpha far above any real adapter's (1-512); a float32 holds it (GGUF stores it so)."""
MAX_DELTA = 1e30
"""Bound on every entry of ``s * B @ A`` (|s| r max|A| max|B|): past it the adapted weights
could overflow float32 (a real adapter's bound is below 1e4)."""
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_UNSET = (None, False, "none", [], {}, "")
"""The values that leave one of :data:`_VARIANTS` off (of their own type: 0 is not False)."""
_FIX = "use the adapter folder a LoRA run wrote (its final/), unchanged"
_VARIANTS = {
    "use_dora": "DoRA, a learned magnitude per output", "bias": "trained biases",
    "lora_bias": "a trained bias of B", "fan_in_fan_out": "transposed weights (GPT-2's Conv1D)",
    "modules_to_save": "fully trained modules", "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas", "layers_to_transform": "adapters on some layers only",
    "layers_pattern": "adapters on some layers only",
    "trainable_token_indices": "trained token embeddings",
    "target_parameters": "adapters on parameters", "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "exclude_modules": "modules left out of the targets"}
"""adapter_config.json keys that, set, make an adapter compute something plain LoRA does not."""


@dataclass(frozen=True)
class Adapter:
    """A checked LoRA adapter folder and the base model it adapts."""
    folder: Path
    base: Path
    """The base model folder."""
    spec: ModelSpec
    """The base model's."""
    lora: LoraSpec
    """Rank, alpha, rsLoRA and the targets (PEFT module names, layer order)."""
    tensors: dict[str, torch.Tensor]
    """PEFT name -> fp32 tensor."""

    def pair(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of target ``target`` (e.g. "q_proj") in decoder layer ``layer``."""
        name = PEFT_PREFIX + hf_name(f"layer{layer}", PROJECTIONS[target])
        return self.tensors[f"{name}.lora_A.weight"], self.tensors[f"{name}.lora_B.weight"]

    def add_to_layer(self, layer: int, views: dict[str, torch.Tensor]) -> None:
        """Add ``s * B @ A`` to each adapted matrix of a layer (its views, by local name, on
        any device; the sum in fp32, as the merged export computes it)."""
        for t in layer_targets(self.spec, self.lora, layer):
            a, b = self.pair(layer, t)
            w = views[PROJECTIONS[t] + ".weight"]
            w.copy_(w.float() + (self.lora.scaling * (b @ a)).to(w.device))


def is_adapter_folder(folder: Path | str) -> bool:
    """Whether ``folder`` holds an adapter (its config or its weights) and no model."""
    folder = Path(folder)
    return not (folder / "config.json").is_file() and any(
        (folder / f).is_file() for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "adapter_model.bin"))


def read_adapter(folder: Path | str, base_dir: Path | str | None = None) -> Adapter:
    """The adapter in ``folder``, checked against its base model (``base_dir``, default the
    config's ``base_model_name_or_path``); one :class:`UserError` for every way it is broken."""
    folder = Path(folder)
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise UserError(path, "is missing: the folder holds adapter weights without their "
                        "settings (rank, alpha, targets)", _FIX)
    cfg = read_json(path, _FIX)
    if not isinstance(cfg, dict):
        raise UserError(path, f"is a JSON {type(cfg).__name__}, not an object", _FIX)
    if (text := lone_surrogate(cfg)) is not None:
        raise UserError(path, f"holds text that is not valid Unicode ({text!r})", _FIX)
    _check_method(cfg, path)
    base = _base(cfg, base_dir, path)
    spec = load_spec(base)
    lora = _settings(cfg, spec, path)
    adapter = Adapter(folder, base, spec, lora, _tensors(folder, spec, lora))
    _check_scale(adapter)
    return adapter


def _check_scale(adapter: Adapter) -> None:
    """``s * B @ A`` cannot overflow: each entry is a sum of r products, so |s| r max|A| max|B|
    bounds it (checked without the products)."""
    lora = adapter.lora
    for i in range(adapter.spec.num_layers):
        for t in layer_targets(adapter.spec, lora, i):
            a, b = adapter.pair(i, t)
            bound = lora.scaling * lora.rank * float(a.abs().max()) * float(b.abs().max())
            if bound > MAX_DELTA:
                raise UserError(adapter.folder / ADAPTER_WEIGHTS, f"has layer {i}'s {t} adapter "
                                f"so large that s * B @ A may reach {bound:.3g} (s = "
                                f"{lora.scaling:g}): the adapted weights would overflow",
                                "use the adapter of an earlier checkpoint: these weights "
                                "diverged")


def _check_method(cfg: dict, path: Path) -> None:
    """Plain LoRA, nothing that changes its formula."""
    kind, fix = cfg.get("peft_type"), ("merge the adapter into its base with PEFT and use the "
                                       "merged model folder")
    if kind != "LORA":
        what = "has no peft_type" if kind is None else f"is a PEFT {kind!r} adapter (peft_type)"
        raise UserError(path, f"{what}; only LoRA adapters are read", fix)
    for key, what in _VARIANTS.items():
        v = cfg.get(key)
        if not any(v == u and type(v) is type(u) for u in _UNSET):
            shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
            raise UserError(path, f"has {key} = {shown}: {what}, which this engine does not "
                            "compute (run as plain LoRA it would be another model)", fix)


def _number(cfg: dict, key: str, path: Path, default=None) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UserError(path, f"has {key} = {v!r}, not a finite number", _FIX)
    return v


def _settings(cfg: dict, spec: ModelSpec, path: Path) -> LoraSpec:
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise UserError(path, f"has r = {rank!r}, not a rank from 1 to {MAX_RANK:,}", _FIX)
    alpha = _number(cfg, "lora_alpha", path)
    if not 0 < alpha <= MAX_ALPHA:
        raise UserError(path, f"has lora_alpha = {alpha!r}; it must be above 0 and at most "
                        f"{MAX_ALPHA:g}", _FIX)
    dropout = _number(cfg, "lora_dropout", path, 0.0)
    if not 0 <= dropout < 1:
        raise UserError(path, f"has lora_dropout = {dropout!r}, not a probability in [0, 1)",
                        _FIX)
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise UserError(path, f"has use_rslora = {rslora!r}, not true or false", _FIX)
    return LoraSpec(rank, float(alpha), float(dropout), _targets(cfg, spec, path), rslora)


def _targets(cfg: dict, spec: ModelSpec, path: Path) -> tuple[str, ...]:
    names = cfg.get("target_modules")
    if isinstance(names, str):
        raise UserError(path, f"has target_modules = {names!r}, a pattern PEFT matches against "
                        "module names", "list the projections, e.g. [\"q_proj\", \"v_proj\"] "
                        "(a LoRA run writes the list)")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise UserError(path, f"has target_modules = {names!r}, not a list of projection "
                        "names", _FIX)
    present = adaptable(spec)
    for n in names:
        if n not in PROJECTIONS or PROJECTIONS[n] + ".weight" not in present:
            raise UserError(path, f"targets {n!r}, which a {spec.model_type} decoder layer does "
                            f"not have (its projections: {', '.join(_projections(spec))})",
                            "give the base model the adapter was trained on (--base)")
    return tuple(t for t in PROJECTIONS if t in names)


def _projections(spec: ModelSpec) -> list[str]:
    present = adaptable(spec)
    return [t for t, local in PROJECTIONS.items() if local + ".weight" in present]


def _base(cfg: dict, base_dir: Path | str | None, path: Path) -> Path:
    named = cfg.get("base_model_name_or_path")
    if base_dir is None and not isinstance(named, str):
        raise UserError(path, f"has base_model_name_or_path = {named!r}, not a folder name",
                        "give the base model's folder (--base)")
    base = Path(base_dir if base_dir is not None else named)
    try:
        found = (base / "config.json").is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        found = False
    if not found:
        shown = str(base) if len(str(base)) <= 200 else str(base)[:200] + "..."
        raise UserError(path, f"names the base model {shown!r}, which is not a model folder "
                        "here", "give the base model's folder (--base), the one the adapter was "
                        "trained on")
    return base


def _expected(spec: ModelSpec, lora: LoraSpec) -> dict[str, tuple[int, int]]:
    """PEFT name -> shape of every tensor the adapter must hold."""
    want = {}
    for i in range(spec.num_layers):
        for t in layer_targets(spec, lora, i):
            out, inp = spec.layout(i).shape(PROJECTIONS[t] + ".weight")
            name = PEFT_PREFIX + hf_name(f"layer{i}", PROJECTIONS[t])
            want[f"{name}.lora_A.weight"] = (lora.rank, inp)
            want[f"{name}.lora_B.weight"] = (out, lora.rank)
    return want


def _tensors(folder: Path, spec: ModelSpec, lora: LoraSpec) -> dict[str, torch.Tensor]:
    """The adapter's tensors in fp32, each checked (headers first: nothing is read for a name,
    shape or type that is wrong)."""
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        why = ("holds adapter_model.bin instead (pickle files are not loaded: they can run code)"
               if (folder / "adapter_model.bin").is_file() else "is missing")
        raise UserError(path, why, _FIX)
    want = _expected(spec, lora)
    base_fix = "give the base model the adapter was trained on (--base)"
    try:
        with safe_open(str(path), framework="pt") as f:
            got = set(f.keys())
            extra, missing = sorted(got - set(want)), sorted(set(want) - got)
            if extra:
                raise UserError(path, f"holds {extra[0]}, which adapts no matrix of the base "
                                "model as adapter_config.json describes it (tensors of that "
                                f"kind: {len(extra)})", base_fix)
            if missing:
                raise UserError(path, f"has no {missing[0]} ({len(missing)} of the tensors "
                                "adapter_config.json implies are missing)", _FIX)
            out = {}
            for name, shape in want.items():
                piece = f.get_slice(name)
                if tuple(piece.get_shape()) != shape:
                    raise UserError(path, f"holds {name} of shape {piece.get_shape()}; with "
                                    f"r = {lora.rank} and the base's layers it must be "
                                    f"{list(shape)}", base_fix)
                if piece.get_dtype() not in FLOAT_DTYPES:
                    raise UserError(path, f"holds {name} as {piece.get_dtype()}, not a float "
                                    f"type ({', '.join(FLOAT_DTYPES)})", _FIX)
                out[name] = f.get_tensor(name).float()
                if not torch.isfinite(out[name]).all():
                    raise UserError(path, f"holds NaN or infinite values in {name}",
                                    "use the adapter of an earlier checkpoint: these weights "
                                    "are corrupt")
    except (SafetensorError, OSError) as e:
        raise UserError(path, f"cannot be read as safetensors ({e})", _FIX) from None
    return out
