"""Hostile corpus, category adapter folders: LoRA adapter folders (what a LoRA run writes as
``final/``) broken the ways adapter_fuzz.py breaks them, through ``slideformer chat`` and
``export-gguf``: adapter_config.json missing, not JSON, of the wrong types, naming modules or a
base the adapter does not fit, asking for DoRA or another PEFT method; the weights missing,
pickled, cut short, of the wrong shapes or rank, NaN, with tensors added or dropped.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

import adapter_fuzz as af
from adapter_fuzz import (DELETE, AdapterBreak, base_named, config_key, cut_weights, extra_tensor,
                          tensor_break, weights_file, whole_config)
from hostile_corpus import TINY, Case

ADAPTER = "run/final"
CFG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _bases(w: Path) -> dict[str, Path]:
    """The folders a broken config may name as its base (built when a case asks for one)."""
    from slideformer.engine.models.tiny import make_tiny_model

    class Lazy(dict):
        def __missing__(self, which: str) -> Path:
            shape = {"other-width": replace(TINY, hidden=64),
                     "fewer-layers": replace(TINY, layers=1)}.get(which)
            path = w / which
            if shape is not None:
                make_tiny_model(path, "llama", shape, seed=5)
            elif which == "not-a-model":
                path.mkdir()
            self[which] = path
            return path
    return Lazy()


def adapter(*breaks: AdapterBreak) -> Callable[[Path], None]:
    """Prepare a case: the adapter a LoRA run on the work folder's model writes, broken."""
    def prepare(w: Path) -> None:
        folder = w / ADAPTER
        af.write_adapter_folder(folder, w / "model")
        bases = _bases(w)
        for b in breaks:
            b.change(folder, bases)
    return prepare


def chat(name: str, words: tuple[str, ...], *breaks: AdapterBreak) -> Case:
    return Case(f"chat: {name}", ("chat", "--model", ADAPTER, "--device", "cpu"), words,
                adapter(*breaks))


def export(name: str, words: tuple[str, ...], *breaks: AdapterBreak, code: int = 2) -> Case:
    return Case(f"export-gguf: {name}", ("export-gguf", ADAPTER, "--out", "adapter.gguf"), words,
                adapter(*breaks), code=code)


def _scaled(factor: float) -> AdapterBreak:
    """Every B multiplied by ``factor`` (a diverged adapter)."""
    def change(d: Path, bases: dict) -> None:
        from safetensors.torch import load_file, save_file
        t = load_file(str(d / WEIGHTS))
        save_file({k: v * factor if ".lora_B." in k else v for k, v in t.items()},
                  str(d / WEIGHTS))
    return AdapterBreak(WEIGHTS, f"B times {factor:g}", change, True, "tensors")


FIRST_A = 0
"""Index of a lora_A tensor (the names sorted: layer 0's down_proj A)."""

ADAPTER_FOLDERS = [
    # ---- adapter_config.json
    chat("adapter_config.json missing", (CFG, "missing"), whole_config(None)),
    export("adapter_config.json missing", (CFG, "missing"), whole_config(None)),
    chat("adapter_config.json not JSON", (CFG, "not valid JSON"), whole_config(b"{")),
    export("adapter_config.json a list", (CFG, "not an object"), whole_config(b"[1]")),
    chat("r = 0", (CFG, "r = 0"), config_key("r", 0)),
    export("r a string", (CFG, "r = '4'"), config_key("r", "4")),
    chat("r = true", (CFG, "r = True"), config_key("r", True)),
    chat("lora_alpha a string", (CFG, "lora_alpha"), config_key("lora_alpha", "16")),
    export("lora_alpha NaN", (CFG, "lora_alpha"), config_key("lora_alpha", math.nan)),
    export("lora_alpha 1e300", (CFG, "lora_alpha", "at most"), config_key("lora_alpha", 1e300)),
    chat("use_rslora 'yes'", (CFG, "use_rslora"), config_key("use_rslora", "yes")),
    chat("a target the base does not have", (CFG, "qkv_proj", "llama"),
         config_key("target_modules", ["q_proj", "qkv_proj"])),
    export("lm_head as a target", (CFG, "lm_head"), config_key("target_modules", ["lm_head"])),
    chat("target_modules a pattern", (CFG, "pattern"), config_key("target_modules", ".*proj")),
    chat("fewer targets than the tensors", (WEIGHTS, "adapts no matrix"),
         config_key("target_modules", ["q_proj", "v_proj"])),
    # ---- the base model
    chat("base folder missing", (CFG, "not a model folder here"), base_named("missing")),
    export("base folder missing", (CFG, "not a model folder here"), base_named("missing")),
    export("base folder without config.json", (CFG, "not a model folder"),
           base_named("not-a-model")),
    chat("base of another width", (WEIGHTS, "shape"), base_named("other-width")),
    export("base of fewer layers", (WEIGHTS, "adapts no matrix"), base_named("fewer-layers")),
    chat("base named by 300 characters", (CFG, "not a model folder"),
         config_key("base_model_name_or_path", "a" * 300)),
    chat("base named with a lone surrogate", (CFG, "not valid Unicode"),
         config_key("base_model_name_or_path", "model\ud800")),
    chat("base not named", (CFG, "base_model_name_or_path"),
         config_key("base_model_name_or_path", DELETE)),
    # ---- adapter_model.safetensors
    chat("weights missing", (WEIGHTS, "missing"), weights_file("missing")),
    export("weights in a pickle", (WEIGHTS, "pickle"), weights_file("pickle")),
    chat("weights cut in half", (WEIGHTS, "cannot be read as safetensors"), cut_weights(0.5)),
    export("weights empty", (WEIGHTS, "cannot be read"), weights_file("empty")),
    chat("A transposed", (WEIGHTS, "shape"), tensor_break("transpose", FIRST_A)),
    export("tensors of rank 5 for r = 4", (WEIGHTS, "r = 4"), tensor_break("rank+1", 0)),
    chat("one A of rank 3", (WEIGHTS, "r = 4"), tensor_break("rank-1", FIRST_A)),
    chat("NaN in a weight", (WEIGHTS, "NaN"), tensor_break("nan", FIRST_A)),
    export("infinity in a weight", (WEIGHTS, "infinite"), tensor_break("inf", FIRST_A)),
    chat("an extra tensor", (WEIGHTS, "lm_head.lora_A", "adapts no matrix"),
         extra_tensor("base_model.model.lm_head.lora_A.weight")),
    chat("a tensor missing", (WEIGHTS, "has no"), tensor_break("drop", FIRST_A)),
    export("integer weights", (WEIGHTS, "I32", "not a float type"),
           tensor_break("int32", FIRST_A)),
    export("B so large the adapted weights overflow", (WEIGHTS, "overflow"), _scaled(1e30)),
    # ---- what plain LoRA does not compute: refused, not approximated
    chat("DoRA", (CFG, "DoRA"), config_key("use_dora", True)),
    export("DoRA", (CFG, "DoRA"), config_key("use_dora", True)),
    chat("DoRA magnitudes without use_dora", (WEIGHTS, "lora_magnitude_vector"),
         extra_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector")),
    chat("a LoHa adapter", (CFG, "LOHA"), config_key("peft_type", "LOHA")),
    export("peft_type missing", (CFG, "peft_type"), config_key("peft_type", DELETE)),
    chat("trained biases", (CFG, "bias"), config_key("bias", "all")),
    chat("modules_to_save", (CFG, "modules_to_save"), config_key("modules_to_save", ["lm_head"])),
    export("rank_pattern", (CFG, "rank_pattern"), config_key("rank_pattern", {"q_proj": 8})),
    chat("fan_in_fan_out", (CFG, "fan_in_fan_out"), config_key("fan_in_fan_out", True)),
    chat("exclude_modules", (CFG, "exclude_modules"), config_key("exclude_modules", ["q_proj"])),
    # ---- what is taken
    export("an intact adapter", ("created", "LoRA adapter"), code=0),
    export("keys that change nothing", ("created",), config_key("task_type", [1, "x"]),
           config_key("unknown_key", {"a": None}), code=0),
    export("fp16 weights", ("created",), tensor_break("float16", FIRST_A), code=0),
]
"""Named cases of the adapter fuzz's shapes (tests/hostile/test_adapter_fuzz.py)."""
