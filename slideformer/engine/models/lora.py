"""LoRA adapters of the decoder layers: settings, flat layout, initialisation and the forward.

A target projection ``W`` (out, in) of a frozen layer gains a low-rank update (Hu et al. 2021;
PEFT's ``lora.Linear``):

    y = x W^T + b + s * B(A(drop(x)))        A: (r, in), B: (out, r), s = alpha / r
                                              (alpha / sqrt(r) with rsLoRA)

Each decoder layer's adapters are one flat buffer (a :class:`Layout`, like the layer itself),
named as PEFT names them inside a layer (``self_attn.q_proj.lora_A.weight``), so export is a
prefix, not a mapping table. Dropout masks are drawn from a generator seeded per (step, layer,
micro-batch, projection): the backward's recompute draws the same mask as the forward did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import Layout, ModelSpec

PROJECTIONS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
               "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
               "down_proj": "mlp.down_proj",
               "qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}
"""PEFT's target-module names -> the projection's name inside a decoder layer (the adapters'
order; Phi-3's fused qkv_proj and gate_up_proj come last, so the others keep their places and
their dropout seeds)."""


@dataclass(frozen=True)
class LoraSpec:
    """Checked adapter settings (from slideformer.engine.config.LoraConfig)."""
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    """PEFT module names in layer order, e.g. ("q_proj", "v_proj")."""
    rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def lora_spec(cfg) -> LoraSpec:
    """A :class:`LoraSpec` from the ``[lora]`` section, one clear error per bad value."""
    if cfg.rank < 1:
        raise UserError("lora.rank", f"is {cfg.rank}", "give a positive integer, e.g. 8 or 16")
    if not cfg.alpha > 0:
        raise UserError("lora.alpha", f"is {cfg.alpha}", "give a positive number, e.g. the rank")
    if not 0.0 <= cfg.dropout < 1.0:
        raise UserError("lora.dropout", f"is {cfg.dropout}", "give a probability in [0, 1)")
    names = [t.strip() for t in cfg.target_modules.split(",") if t.strip()]
    unknown = [t for t in names if t not in PROJECTIONS]
    if unknown or not names:
        raise UserError("lora.target_modules", f"{cfg.target_modules!r} names "
                        f"{', '.join(unknown) or 'no projection'}",
                        f"use a comma-separated subset of {','.join(PROJECTIONS)}")
    return LoraSpec(cfg.rank, float(cfg.alpha), float(cfg.dropout),
                    tuple(t for t in PROJECTIONS if t in names), cfg.use_rslora)


FUSED = {"qkv_proj": {"q_proj", "k_proj", "v_proj"}, "gate_up_proj": {"gate_proj", "up_proj"}}
"""A fused projection gets an adapter when any of the projections it holds is a target."""


def for_model(lora: LoraSpec, spec: ModelSpec) -> LoraSpec:
    """``lora`` with only the targets this model's layers have: in a mixture of experts the
    MLP names (gate_proj, up_proj, down_proj) match no tensor, so adapters train on attention
    and the experts and router stay frozen (PEFT's ``target_modules`` reaches no stacked
    experts either). Its dense layers (Qwen3-MoE's ``mlp_only_layers``) keep their MLP frozen
    too (:func:`adaptable`)."""
    present = adaptable(spec)
    wanted = set(lora.targets)
    wanted |= {f for f, parts in FUSED.items() if wanted & parts}  # Phi-3's fused projections
    kept = tuple(t for t in PROJECTIONS if t in wanted and PROJECTIONS[t] + ".weight" in present)
    if not kept:
        raise UserError("lora.target_modules", f"{','.join(lora.targets)} names no projection "
                        f"a {spec.model_type} layer has", "add q_proj,k_proj,v_proj,o_proj")
    return replace(lora, targets=kept)


def adaptable(spec: ModelSpec) -> set[str]:
    """The names of the layers' tensors an adapter may target: any layer's, but in a mixture
    of experts no MLP's, even in its dense layers. PEFT (0.21) maps the MLP names of a
    mixture-of-experts model onto the experts and adapts no dense layer's MLP (measured on
    Qwen3-MoE with ``mlp_only_layers``), so an adapter written here loads there the same.
    Gemma 4's experts sit beside a dense MLP of plain Linears, which PEFT adapts (measured)."""
    beside = spec.moe is not None and spec.family.moe.gemma4
    return {n for lay in set(spec.layouts) for n in lay.names()
            if spec.moe is None or beside or not n.startswith("mlp.")}


def adapter_layout(spec: ModelSpec, lora: LoraSpec, layer: int) -> Layout:
    """The flat layout of decoder layer ``layer``'s adapters: A then B of each target (of
    :func:`for_model`) the layer has (layers may differ: ModelSpec.layout), target order."""
    base, shapes = spec.layout(layer), []
    for t in layer_targets(spec, lora, layer):
        out, inp = base.shape(PROJECTIONS[t] + ".weight")
        shapes += [(f"{PROJECTIONS[t]}.lora_A.weight", (lora.rank, inp)),
                   (f"{PROJECTIONS[t]}.lora_B.weight", (out, lora.rank))]
    return Layout.build(shapes)


def layer_targets(spec: ModelSpec, lora: LoraSpec, layer: int) -> tuple[str, ...]:
    """The targets decoder layer ``layer`` has (a hybrid's gated DeltaNet layers have no
    attention projections), in target order."""
    present = set(spec.layout(layer).names())
    return tuple(t for t in lora.targets if PROJECTIONS[t] + ".weight" in present)


def adapter_params(spec: ModelSpec, lora: LoraSpec) -> int:
    """Every decoder layer's adapter parameters, all together."""
    return sum(adapter_layout(spec, lora, i).numel for i in range(spec.num_layers))


def init_adapter(layout: Layout, flat: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """PEFT's default init in place: A as nn.Linear (kaiming-uniform, a=sqrt(5)), B = 0, so
    the adapted model starts as the base model."""
    for name, view in layout.views(flat).items():
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(view, a=math.sqrt(5), generator=generator)
        else:
            view.zero_()
    return flat


class LoraForward:
    """The adapters of one layer for one micro-batch, as :func:`decoder_layer` applies them.

    ``p``: the adapter views (:func:`adapter_layout`); ``seed``: None without dropout (or in
    evaluation), else the seed of this (step, layer, micro-batch).
    """

    def __init__(self, lora: LoraSpec, p: dict[str, torch.Tensor], seed: int | None):
        self.lora, self.p, self.seed = lora, p, seed

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + s * B(A(drop(x))) if projection ``name`` (e.g. "self_attn.q_proj") has an adapter."""
        a = self.p.get(name + ".lora_A.weight")
        if a is None:
            return y
        if self.seed is not None:
            x = self._dropout(name, x)
        return y + F.linear(F.linear(x, a), self.p[name + ".lora_B.weight"]) * self.lora.scaling

    def _dropout(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Inverted dropout with a mask that depends only on (seed, projection)."""
        k = list(PROJECTIONS.values()).index(name)
        g = torch.Generator(x.device).manual_seed(self.seed * 8 + k)
        keep = torch.rand(x.shape, generator=g, device=x.device) >= self.lora.dropout
        return x * keep.to(x.dtype) / (1.0 - self.lora.dropout)


def dropout_seed(seed: int, step: int, layer: int, micro: int) -> int:
    """The dropout seed of one (step, layer, micro-batch): distinct for each, reproducible."""
    return (((seed * 1_000_003 + step) * 4099 + layer) * 65_537 + micro) % (1 << 59)
