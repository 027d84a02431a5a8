"""Hostile LoRA adapter folders for property-based testing (hypothesis strategies).

:func:`write_adapter_folder` writes what a LoRA run writes as ``final/`` (PEFT's
adapter_config.json and adapter_model.safetensors, random B so the adapter does something); an
:class:`AdapterBreak` breaks a copy: adapter_config.json's keys set to any JSON value or deleted
(ranks, alphas, targets naming modules the base lacks, base folders that are missing or another
model, DoRA and other PEFT methods), the file replaced or missing; the weights missing, cut
short, in a pickle, with tensors dropped, added, transposed, of another rank, another dtype, or
NaN. Each says whether the engine must refuse it. :func:`check_adapter` is the property, through
both readers: ``slideformer chat`` (the adapted weights read as chat reads them) and
``export-gguf`` (the GGUF LoRA adapter).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from folder_fuzz import DELETE, edit_json, hostile_value, truncated
from gguf_fuzz import bounded
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from slideformer.engine.errors import UserError

TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 4, 8.0
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def write_adapter_folder(folder: Path, base: Path, rank: int = RANK,
                         targets: tuple[str, ...] = TARGETS, seed: int = 0) -> None:
    """A LoRA run's adapter folder for ``base`` (its files and names as lora_export writes
    them), with random A and B."""
    from slideformer.engine.models.lora import PROJECTIONS, LoraSpec
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.weights import hf_name
    from slideformer.engine.train.lora_export import adapter_config
    spec, g = load_spec(base), torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(spec.num_layers):
        for t in targets:
            out, inp = spec.layer_layout.shape(PROJECTIONS[t] + ".weight")
            name = PEFT_PREFIX + hf_name(f"layer{i}", PROJECTIONS[t])
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    lora = LoraSpec(rank, ALPHA, 0.0, targets)
    (folder / CONFIG).write_text(json.dumps(adapter_config(lora, str(base))))


@dataclass(frozen=True)
class AdapterBreak:
    """One change to an adapter folder."""
    file: str
    what: str
    change: Callable[[Path, dict], None]
    """Breaks the folder; gets the other folders a change may name (``bases``: name -> path)."""
    must_refuse: bool
    target: str
    """What it changes (a key, the tensors, a file): two breakages of one target may undo each
    other, so neither verdict then stands."""

    def __repr__(self) -> str:
        return f"{self.file}: {self.what}"


# ---- adapter_config.json -------------------------------------------------------------------------
FREE_KEYS = ("task_type", "inference_mode", "init_lora_weights", "revision", "auto_mapping",
             "unknown_key")
"""Keys that do not change what the adapter computes: any value may be taken."""
VARIANT_KEYS = ("use_dora", "bias", "lora_bias", "fan_in_fan_out", "modules_to_save",
                "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
                "trainable_token_indices", "target_parameters", "use_qalora", "exclude_modules")
"""Keys that, set, make an adapter compute something else (each must be refused)."""
_UNSET = (None, False, "none", [], {}, "")


def _config_verdict(key: str, value) -> bool:
    """Whether ``key = value`` (DELETE: removed) must be refused."""
    if key in FREE_KEYS:
        return False
    if key in VARIANT_KEYS:
        return value is not DELETE and not any(value == u and type(value) is type(u)
                                               for u in _UNSET)
    if key == "peft_type":
        return value != "LORA"
    if key == "r":
        return value != RANK or type(value) is not int
    if key == "lora_alpha":
        return (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0)
    if key == "lora_dropout":
        return value is not DELETE and not (type(value) in (int, float) and 0 <= value < 1)
    if key == "use_rslora":  # True: another scale, still plain LoRA
        return value is not DELETE and not isinstance(value, bool)
    if key == "target_modules":  # the same projections in another order, or repeated: taken
        return not (isinstance(value, list) and all(isinstance(v, str) for v in value)
                    and set(value) == set(TARGETS))
    return True  # base_model_name_or_path: any other value names no base


def config_key(key: str, value) -> AdapterBreak:
    shown = "<deleted>" if value is DELETE else repr(value)[:80]
    return AdapterBreak(CONFIG, f"{key} = {shown}",
                        lambda d, bases: edit_json(d / CONFIG, {key: value}),
                        _config_verdict(key, value), key)


def base_named(which: str) -> AdapterBreak:
    """base_model_name_or_path naming another folder: ``missing``, ``other-width`` (another
    hidden size), ``fewer-layers``, ``not-a-model`` (a folder without config.json)."""
    def change(d: Path, bases: dict) -> None:
        edit_json(d / CONFIG, {"base_model_name_or_path": str(bases[which])})
    return AdapterBreak(CONFIG, f"base is {which}", change, True, "base_model_name_or_path")


def whole_config(raw: bytes | None) -> AdapterBreak:
    """adapter_config.json replaced by ``raw`` (None: deleted)."""
    def change(d: Path, bases: dict) -> None:
        if raw is None:
            (d / CONFIG).unlink()
        else:
            (d / CONFIG).write_bytes(raw)
    return AdapterBreak(CONFIG, f"the whole file is {raw!r}"[:100], change, True, CONFIG)


_rank = st.sampled_from([0, -1, 1, 2, RANK, 8, 2**16 + 1, 2**40, "4", 4.0, True, None])
_targets = st.one_of(
    st.lists(st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj", "qkv_proj", "gate_up_proj", "lm_head",
                              "embed_tokens", "self_attn.q_proj", ""]), max_size=4),
    st.sampled_from([".*proj", "all-linear", "q_proj"]), hostile_value)
_peft = st.one_of(st.sampled_from(["LORA", "LOHA", "LOKR", "ADALORA", "IA3", "lora", ""]),
                  hostile_value)
_variant_values = st.one_of(st.sampled_from([True, False, None, "all", "lora_only", "none",
                                             ["lm_head"], {"q_proj": 8}, [0], []]),
                            hostile_value)
_CONFIG_KEYS = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                "base_model_name_or_path", "use_rslora") + VARIANT_KEYS + FREE_KEYS
config_breaks = st.one_of(
    st.builds(config_key, st.sampled_from(_CONFIG_KEYS), st.one_of(st.just(DELETE),
                                                                     hostile_value)),
    st.builds(config_key, st.just("r"), _rank),
    st.builds(config_key, st.just("lora_alpha"), st.one_of(
        st.sampled_from([0, -8, 8, 16.0, "8", math.nan, math.inf, 1e300]), hostile_value)),
    st.builds(config_key, st.just("target_modules"), _targets),
    st.builds(config_key, st.just("peft_type"), _peft),
    st.builds(config_key, st.sampled_from(VARIANT_KEYS), _variant_values),
    st.builds(config_key, st.just("base_model_name_or_path"), st.one_of(
        st.sampled_from(["", "/", ".", "org/some-model", "nowhere", "a" * 300, "\ud800",
                         "nul\x00"]), hostile_value)),
    st.builds(base_named, st.sampled_from(["missing", "other-width", "fewer-layers",
                                           "not-a-model"])),
    st.builds(whole_config, st.one_of(st.none(), st.sampled_from(
        [b"", b"{", b"[1]", b'"LORA"', b"\xff\xfe", b"[" * 100_000]),
        hostile_value.map(lambda v: json.dumps(v, allow_nan=True).encode("utf-8",
                                                                        "surrogatepass")))))


# ---- adapter_model.safetensors ----------------------------------------------------------------
def _edit_tensors(edit: Callable[[dict], None]) -> Callable[[Path, dict], None]:
    def change(d: Path, bases: dict) -> None:
        tensors = load_file(str(d / WEIGHTS))
        edit(tensors)
        save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})
    return change


def _nth(tensors: dict, index: int) -> str:
    names = sorted(tensors)
    return names[index % len(names)]


def tensor_break(kind: str, index: int) -> AdapterBreak:
    """drop, transpose, nan, inf, int32, float16, float64, bool, rank+1 (every tensor), rank-1
    (one tensor), zeros (all: a valid adapter that does nothing)."""
    def edit(t: dict) -> None:
        name = _nth(t, index)
        if kind == "drop":
            del t[name]
        elif kind == "transpose":
            t[name] = t[name].T.contiguous()
        elif kind in ("nan", "inf"):
            t[name][0, index % t[name].shape[1]] = math.nan if kind == "nan" else -math.inf
        elif kind == "rank+1":
            for k in t:
                dim = 0 if ".lora_A." in k else 1
                t[k] = torch.cat([t[k], t[k].narrow(dim, 0, 1)], dim=dim)
        elif kind == "rank-1":
            dim = 0 if ".lora_A." in name else 1
            t[name] = t[name].narrow(dim, 0, RANK - 1).contiguous()
        elif kind == "zeros":
            for k in t:
                t[k] = torch.zeros_like(t[k])
        else:
            t[name] = t[name].to(getattr(torch, kind))
    free = kind in ("zeros", "float16", "float64")  # valid adapters (float types)
    return AdapterBreak(WEIGHTS, f"{kind} tensor #{index}", _edit_tensors(edit), not free,
                        "tensors")


EXTRA_NAMES = ["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
               "base_model.model.lm_head.lora_A.weight",
               "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
               "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight",
               "base_model.model.model.layers.0.self_attn.q_proj.bias", "x"]


def extra_tensor(name: str) -> AdapterBreak:
    def edit(t: dict) -> None:
        t[name] = torch.zeros(RANK, 8)
    return AdapterBreak(WEIGHTS, f"extra tensor {name}", _edit_tensors(edit), True, "tensors")


def weights_file(kind: str) -> AdapterBreak:
    """missing, pickle (adapter_model.bin instead), empty."""
    def change(d: Path, bases: dict) -> None:
        path = d / WEIGHTS
        if kind == "pickle":
            path.rename(d / "adapter_model.bin")
        elif kind == "missing":
            path.unlink()
        else:
            path.write_bytes(b"")
    return AdapterBreak(WEIGHTS, kind, change, True, WEIGHTS)


def cut_weights(fraction: float) -> AdapterBreak:
    inner = truncated(WEIGHTS, fraction)
    return AdapterBreak(WEIGHTS, inner.what, lambda d, bases: inner.change(d), True, WEIGHTS)


tensor_breaks = st.one_of(
    st.builds(tensor_break, st.sampled_from(["drop", "transpose", "nan", "inf", "int32",
                                             "float16", "float64", "bool", "rank+1", "rank-1",
                                             "zeros"]), st.integers(0, 100)),
    st.builds(extra_tensor, st.sampled_from(EXTRA_NAMES)),
    st.builds(weights_file, st.sampled_from(["missing", "pickle", "empty"])),
    st.builds(cut_weights, st.floats(0, 0.999)))

breaks = st.lists(st.one_of(config_breaks, tensor_breaks), min_size=1, max_size=2)
"""One or two breakages of one adapter folder."""


# ---- the property -------------------------------------------------------------------------------
def must_refuse(broken: list[AdapterBreak]) -> bool:
    """Whether the folder must be refused: a breakage says so and no other changed the same
    thing."""
    targets = [b.target for b in broken]
    return any(b.must_refuse and targets.count(b.target) == 1 for b in broken)


def check_adapter(folder: Path, bases: dict, broken: list[AdapterBreak], tmp: Path) -> str:
    """Chat and export on the broken folder: both take it (``taken``) or both refuse it
    (``refused``) with one UserError naming the adapter folder's file or a base folder; a
    breakage that must be refused is (unless another changed the same thing); nothing is left
    behind by a refused export."""
    from slideformer.engine.generate.session import ChatModel
    from slideformer.engine.gguf.lora_adapter import export_lora_gguf
    outcomes = []
    try:
        with bounded(60, 2 << 30):
            ChatModel(folder, mode="resident", device="cpu").close()
        outcomes.append(None)
    except UserError as e:
        outcomes.append(e)
    out = tmp / "adapter.gguf"
    try:
        with bounded(60, 2 << 30):
            export_lora_gguf(folder, out)
        outcomes.append(None)
    except UserError as e:
        assert not list(tmp.glob("adapter.gguf*")), "export left a file behind"
        outcomes.append(e)
    chat, export = outcomes
    for e in (chat, export):
        if e is not None:
            named = [str(folder)] + [str(p) for p in bases.values()]
            assert any(n in str(e) for n in named), f"{str(e)!r} names no file of the adapter"
    assert (chat is None) == (export is None), f"chat: {chat}; export: {export}"
    if chat is None:
        assert not must_refuse(broken), f"took {broken}"
        return "taken"
    return "refused"
