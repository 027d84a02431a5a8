"""Family <-> GGUF architecture, and GGUF tensor names.

Tensor names come from the ``gguf`` package's own map (``gguf.get_tensor_name_map``), queried
with the Hugging Face names of the engine's layouts, so no name table is kept here. What the
converter does to the values is :mod:`slideformer.engine.gguf.transforms`.
"""
from __future__ import annotations

import gguf

from slideformer.engine.errors import UserError
from slideformer.engine.models.families import FAMILIES
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.models.weights import hf_name, item_layout, item_names

_BY_NAME = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
# Hugging Face model_type -> GGUF general.architecture (each family's ``gguf``, as llama.cpp
# names it: "gpt-oss" is MODEL_ARCH.GPT_OSS). Several families share one architecture in
# llama.cpp's converter: Mistral and Mixtral are "llama" (told apart by general.name and by
# the experts), OLMo 3 is "olmo2" (told apart by its sliding window): importer._family.
ARCH = {mt: _BY_NAME[f.gguf] for mt, f in FAMILIES.items() if f.gguf}
GGUF_ARCHS = {gguf.MODEL_ARCH_NAMES[a]: a for a in ARCH.values()}
"""GGUF architecture name ("llama", "qwen2", "gemma3", ...) -> MODEL_ARCH."""
RENAMED = {"linear_attn.dt_bias": "linear_attn.dt_proj.bias"}
"""Layout names llama.cpp's converter renames before it maps them (Qwen3.5's ``dt_bias`` is
stored as the bias of a ``dt_proj``: ``ssm_dt.bias``)."""
SCALES = {"router.scale": (gguf.MODEL_TENSOR.FFN_GATE_INP, "scale"),
          "router.per_expert_scale": (gguf.MODEL_TENSOR.FFN_DOWN_EXP, "scale")}
"""Layout names the ``gguf`` package's map does not hold, as llama.cpp's converter stores them:
Gemma 4's router scale as ``ffn_gate_inp.scale`` and its per-expert scale (a factor on each
expert's output) as ``ffn_down_exps.scale``."""
WEIGHT_ADDED = ("layer_scalar", "experts.gate_up_proj", "experts.down_proj")
"""Layout names without ``.weight`` whose GGUF name llama.cpp's converter gives one (Gemma 4's
layer scalar and stacked experts; Qwen3.5's ``A_log`` stays ``ssm_a``)."""


def arch_name(model_type: str) -> str:
    """The GGUF ``general.architecture`` of a Hugging Face family."""
    if model_type not in ARCH:
        raise UserError(f"model_type {model_type}", "has no GGUF conversion here yet",
                        f"GGUF import and export support {', '.join(ARCH)}; export the "
                        "Hugging Face folder and convert it with llama.cpp's convert_hf_to_gguf.py")
    return gguf.MODEL_ARCH_NAMES[ARCH[model_type]]


def model_type_of(arch: str) -> str:
    """The first family (in SUPPORTED order) stored as GGUF architecture ``arch``."""
    return next(mt for mt, a in ARCH.items() if gguf.MODEL_ARCH_NAMES[a] == arch)


def tensor_names(spec: ModelSpec) -> dict[str, str]:
    """Hugging Face checkpoint name -> GGUF tensor name, for every tensor of ``spec``."""
    arch_name(spec.model_type)  # a family without a GGUF conversion: one clear message
    name_map = gguf.get_tensor_name_map(ARCH[spec.model_type], spec.num_layers)
    out = {}
    for item in item_names(spec):
        for local in item_layout(spec, item).names():
            out[hf_name(item, local)] = _tensor_name(name_map, item, local, spec.family.gguf)
    if spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _tensor_name(name_map, item: str, local: str, arch: str) -> str:
    """The GGUF name of ``local`` of ``item`` (:data:`SCALES`, :data:`WEIGHT_ADDED`)."""
    if local in SCALES:
        kind, suffix = SCALES[local]
        return f"{gguf.TENSOR_NAMES[kind].format(bid=item[5:])}.{suffix}"
    asked = hf_name(item, RENAMED.get(local, local))
    name = name_map.get_name(asked, try_suffixes=(".weight", ".bias"))
    if name is None:  # a family whose layout the gguf package does not map
        raise ValueError(f"gguf has no {arch} tensor for {asked}")
    return f"{name}.weight" if local in WEIGHT_ADDED else name
