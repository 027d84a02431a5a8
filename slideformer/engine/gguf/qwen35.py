"""Qwen3.5's metadata in GGUF (llama.cpp's ``qwen35`` and ``qwen35moe``), written and read.

What llama.cpp's converter writes beyond a Qwen3 file (its ``Qwen3NextModel`` and
``_Qwen35MRopeMixin``), and its loader reads (``src/models/qwen35.cpp``):

- the gated DeltaNet's sizes as ``{arch}.ssm.*``: ``conv_kernel``, ``state_size`` (the key
  head size, which llama.cpp also takes as the value head size), ``group_count`` (key heads),
  ``time_step_rank`` (value heads), ``inner_size`` (value heads x value head size);
- which layers are DeltaNet layers: ``{arch}.attention.recurrent_layers`` (one flag per
  layer), and ``{arch}.full_attention_interval`` (every n-th layer is full attention), all
  an older llama.cpp reads, written where the layers follow that rule;
- the partial RoPE: ``rope.dimension_count`` is the rotated dimensions (a quarter of a head),
  and ``rope.dimension_sections`` the multimodal RoPE's sections (config.json's
  ``mrope_section``, default [11, 11, 10], padded to four). Text positions are equal in the
  three sections, so the sections change nothing, provided that they give every rotated pair
  a position: llama.cpp's interleaved rule gives pair p the time, height or width position
  when s = p mod sum(sections) is below 3 x sections[s mod 3], else the fourth section's
  (0 for text: no rotation). A config whose sections leave a pair out is refused.
- Qwen3.5-MoE: ``expert_shared_feed_forward_length`` (the exporter writes it with the experts).

The multi-token-prediction block that llama.cpp's converter appends to the layers
(``nextn_predict_layers``) is not part of the model the engine trains: import leaves it out.
"""
from __future__ import annotations

from pathlib import Path

import gguf

from slideformer.engine.errors import UserError
from slideformer.engine.gguf import metadata
from slideformer.engine.models.families.base import FULL, LINEAR
from slideformer.engine.models.spec import ModelSpec

DEFAULT_SECTIONS = (11, 11, 10)
"""transformers' Qwen3.5 rotary sections where config.json names none (so does the converter)."""
RECURRENT = "{arch}.attention.recurrent_layers"
"""llama.cpp's per-layer DeltaNet flags (gguf 0.19 has no writer method for this key yet)."""
_KEEP = "keep the model in its Hugging Face folder"


def write_metadata(w: gguf.GGUFWriter, spec: ModelSpec, model_dir: Path) -> None:
    """The DeltaNet sizes, layer types and RoPE sections, once the model is one llama.cpp
    computes as the engine does."""
    cfg, d = model_dir / "config.json", spec.linear
    if d is None:
        raise UserError(cfg, "has no linear_attention layer, but llama.cpp reads a Qwen3.5's "
                        "DeltaNet sizes from its DeltaNet layers", _KEEP)
    if d.head_k_dim != d.head_v_dim:
        raise UserError(cfg, f"has linear_key_head_dim {d.head_k_dim} and "
                        f"linear_value_head_dim {d.head_v_dim}: llama.cpp sizes both by one "
                        "number (ssm.state_size) and would not load the GGUF",
                        f"{_KEEP} (the Qwen3.5 releases have equal sizes)")
    sections = _sections(spec, cfg)
    w.add_ssm_conv_kernel(d.conv_kernel)
    w.add_ssm_state_size(d.head_k_dim)
    w.add_ssm_group_count(d.num_k_heads)
    w.add_ssm_time_step_rank(d.num_v_heads)
    w.add_ssm_inner_size(d.value_dim)
    recurrent = [spec.is_linear(i) for i in range(spec.num_layers)]
    w.add_array(RECURRENT.format(arch=w.arch), recurrent)
    if (every := _interval(recurrent)) is not None:
        w.add_full_attention_interval(every)
    w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))


def config(g, arch: str, layers: int, head_dim: int, theta: float) -> dict:
    """The Qwen3.5 keys of config.json from the metadata of GGUF ``g`` (a file or a header),
    for a model of ``layers`` layers (the MTP block left out) and ``head_dim``."""
    def need(key: str) -> int:
        v = metadata.value(g, f"{arch}.{key}", int)
        if v is None or v <= 0:
            raise UserError(g.path, f"has no valid '{arch}.{key}' in its metadata",
                            "use a complete GGUF file")
        return v

    nk, nv, inner = need("ssm.group_count"), need("ssm.time_step_rank"), need("ssm.inner_size")
    if inner % nv or nv % nk:
        raise UserError(g.path, f"has {nv} DeltaNet value heads (ssm.time_step_rank) for "
                        f"ssm.inner_size {inner} and {nk} key heads (ssm.group_count)",
                        "use a consistent GGUF file")
    rotary = metadata.value(g, f"{arch}.rope.dimension_count", int, head_dim)
    if not 0 < rotary <= head_dim or int(head_dim * (rotary / head_dim)) != rotary:
        raise UserError(g.path, f"rotates {rotary} of head_dim {head_dim} dimensions "
                        f"('{arch}.rope.dimension_count'), not a share of a head that "
                        "partial_rotary_factor can state", "use a consistent GGUF file")
    sections = metadata.array(g, f"{arch}.rope.dimension_sections", int, list(DEFAULT_SECTIONS))
    if len(sections) > 4 or any(s < 0 for s in sections):
        raise UserError(g.path, f"has '{arch}.rope.dimension_sections' = {list(sections)}, not "
                        "up to four whole numbers", "use a consistent GGUF file")
    return {"linear_num_key_heads": nk, "linear_num_value_heads": nv,
            "linear_key_head_dim": need("ssm.state_size"), "linear_value_head_dim": inner // nv,
            "linear_conv_kernel_dim": need("ssm.conv_kernel"),
            "layer_types": _layer_types(g, arch, layers),
            "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                "partial_rotary_factor": rotary / head_dim,
                                "mrope_interleaved": True, "mrope_section": list(sections[:3])}}


def _layer_types(g, arch: str, layers: int) -> list[str]:
    """llama.cpp's rule: the per-layer flags, else every n-th layer full (n = 4 by default)."""
    flags = metadata.array(g, RECURRENT.format(arch=arch), bool)
    if flags is None:
        every = metadata.value(g, f"{arch}.full_attention_interval", int, 4)
        if every <= 0:
            raise UserError(g.path, f"has '{arch}.full_attention_interval' = {every}",
                            "use a consistent GGUF file")
        flags = [(i + 1) % every != 0 for i in range(layers)]
    if metadata.length(flags) < layers:
        raise UserError(g.path, f"flags {metadata.length(flags)} layers in "
                        f"'{RECURRENT.format(arch=arch)}' for its {layers} layers",
                        "use a consistent GGUF file")
    return [LINEAR if f else FULL for f in flags[:layers]]


def _interval(recurrent: list[bool]) -> int | None:
    """n where exactly every n-th layer is full attention (and at least one is), else None."""
    full = [i for i, r in enumerate(recurrent) if not r]
    if not full:
        return None
    n = full[0] + 1
    return n if recurrent == [(i + 1) % n != 0 for i in range(len(recurrent))] else None


def _sections(spec: ModelSpec, cfg: Path) -> list[int]:
    """config.json's ``mrope_section`` (or the default), checked against llama.cpp's rule."""
    rope = spec.raw_config.get("rope_parameters") or spec.raw_config.get("rope_scaling") or {}
    sections = rope.get("mrope_section", list(DEFAULT_SECTIONS))
    if not (isinstance(sections, list) and 0 < len(sections) <= 4 and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sections)):
        raise UserError(cfg, f"has mrope_section {sections!r}, not up to four whole numbers",
                        "use the config.json that came with the model's weights")
    sec, total = sections + [0] * (4 - len(sections)), sum(sections)
    pairs = (spec.rotary_dim or spec.head_dim) // 2
    if not 0 < total <= spec.head_dim:  # ggml asserts it
        raise UserError(cfg, f"has mrope_section {sections}, whose sum is not in 1.."
                        f"{spec.head_dim} (head_dim) as llama.cpp requires", _KEEP)
    missed = [p for p in range(pairs) if p % total >= 3 * sec[p % total % 3]]
    if missed:
        raise UserError(cfg, f"has mrope_section {sections}, with which llama.cpp would leave "
                        f"rotary pairs {missed[:4]} unrotated where transformers rotates them",
                        _KEEP)
    return sections
