"""Architecture spec read from a Hugging Face ``config.json``, and the flat-buffer layouts.

A decoder layer's parameters live in ONE flat buffer; each weight is a view at a fixed offset
(a :class:`Layout`). The embedding and the head (final norm + LM head) are separate items with
layouts of their own. Parameter names inside a layer are the Hugging Face names without the
``model.layers.{i}.`` prefix, so reading and writing checkpoints is a rename, not a mapping table;
the one exception is a mixture of experts, whose experts are one stacked tensor per projection
here and one tensor per expert on disk (:meth:`ModelSpec.stored_names`).

What differs between families is declared in ``models/families/`` (one file per family).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from slideformer.engine.errors import UserError
from slideformer.engine.jsonfile import read_json, surrogate_key
from slideformer.engine.models.families import FAMILIES, SUPPORTED, TEXT_TOWERS
from slideformer.engine.models.families.base import (FIX, FULL, LINEAR, SLIDING, DeltaNetShape,
                                                     Family, all_layers, check_longrope, flag,
                                                     positive_int, positive_real, rope_of,
                                                     window)

if TYPE_CHECKING:  # spec reading needs no torch: ``info`` and ``plan`` start without it
    import torch

@dataclass(frozen=True)
class Layout:
    """Name -> (offset, shape) of tensors packed into one flat 1-D buffer."""

    entries: tuple[tuple[str, int, tuple[int, ...]], ...]
    numel: int

    @staticmethod
    def build(shapes: list[tuple[str, tuple[int, ...]]]) -> "Layout":
        entries, off = [], 0
        for name, shape in shapes:
            entries.append((name, off, tuple(shape)))
            off += math.prod(shape)
        return Layout(tuple(entries), off)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` (1-D, ``numel`` long) shaped as each entry."""
        return {n: flat[o:o + math.prod(s)].view(s) for n, o, s in self.entries}

    def names(self) -> list[str]:
        return [n for n, _, _ in self.entries]

    def only(self, names) -> "Layout":
        """The entries named in ``names``, in this layout's order and at their offsets here."""
        keep = set(names)
        return Layout(tuple(e for e in self.entries if e[0] in keep), self.numel)

    def shape(self, name: str) -> tuple[int, ...]:
        return next(s for n, _, s in self.entries if n == name)

    def norms(self) -> list[tuple[str, int, int]]:
        """(name, offset, length) of the RMSNorm weights (Gemma 4 numbers some:
        ``post_feedforward_layernorm_1.weight``)."""
        return [(n, o, s[0]) for n, o, s in self.entries if _NORM.search(n)]


_NORM = re.compile(r"norm(_\d+)?\.weight$")



def decayed(name: str, shape: tuple[int, ...]) -> bool:
    """Whether AdamW's weight decay applies to a tensor: matrices, not vectors (norms, biases,
    GPT-OSS's sinks, Gemma 4's router scales), nor norms and biases whatever their shape
    (GPT-OSS stacks its experts' biases as (E, out) matrices)."""
    return len(shape) > 1 and not (name.endswith("norm.weight") or name.endswith("bias"))


@dataclass(frozen=True)
class MoeShape:
    """The mixture-of-experts sizes of a model whose family has a :class:`Moe` feed-forward."""

    experts: int
    top_k: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    width: int
    """Intermediate size of one expert."""
    renormalise: bool
    """The top-k routing weights are renormalised to sum to 1."""
    alpha: float = 0.0
    limit: float = 0.0
    """GPT-OSS's clamped SwiGLU: ``swiglu_alpha`` and ``swiglu_limit`` (models.moe)."""
    shared_width: int = 0
    """The shared expert's intermediate size (Moe.shared; 0: none)."""
    aux_coef: float = 0.0
    """The router's load-balancing loss weight (``router_aux_loss_coef`` while
    ``output_router_logits`` is on, as transformers trains; 0: off; models.moe.RouterAux)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a decoder-only model."""

    model_type: str
    """Hugging Face ``model_type`` (one of SUPPORTED)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """The dense MLP's width (MoE models: unused, see :attr:`moe`)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] | None
    """``rope_scaling`` dict of config.json as sorted items (hashable), or None."""
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on q/k/v projections (qwen2, or ``attention_bias``)."""
    o_bias: bool
    """Bias on the output projection (``attention_bias``)."""
    mlp_bias: bool
    qk_norm: str | None
    """RMSNorm on q and k: None, "head" (per head: qwen3, gemma3) or "full" (olmo2)."""
    max_position_embeddings: int
    sliding_window: int | None
    """Attention window of the layers :attr:`layer_types` marks sliding (a query sees itself and
    the ``sliding_window - 1`` keys before it), None if no layer is windowed."""
    torch_dtype: str
    """Checkpoint dtype declared in config.json (for display and export)."""
    raw_config: dict = field(compare=False, hash=False, repr=False)
    """The config.json as read, written back unchanged on export."""
    family: Family = field(default=None, compare=False, repr=False)
    """What the family's layer does differently (models.families); set from model_type."""
    layer_types: tuple[str, ...] = ()
    """Per layer, "full_attention" or "sliding_attention" (all full when empty)."""
    rope_layers: tuple[bool, ...] = ()
    """Per layer, whether it rotates q and k (SmolLM3's NoPE layers do not; all when empty)."""
    local_rope: tuple[float, tuple | None] | None = None
    """(theta, scaling) of the sliding layers' RoPE when it differs from the full layers'
    (Gemma 3), else None."""
    attn_scale: float | None = None
    """Softmax scale of the attention scores; None: 1/sqrt(head_dim)."""
    moe: MoeShape | None = None
    """The experts of the sparse layers' feed-forward, or None: a dense gated MLP everywhere."""
    sparse: tuple[bool, ...] = ()
    """Per layer of a mixture of experts, whether its feed-forward is the experts (False: a
    dense gated MLP of ``intermediate_size``, Qwen3-MoE's ``mlp_only_layers``); all when empty."""
    rotary_dim: int | None = None
    """The leading dimensions of each head that RoPE rotates (Qwen3.5's
    ``partial_rotary_factor``); None: all of ``head_dim``."""
    linear: DeltaNetShape | None = None
    """The sizes of the gated DeltaNet layers that :attr:`layer_types` marks "linear_attention"
    (Qwen3.5; models.deltanet), or None."""
    attn_shapes: tuple[tuple[int, int], ...] = ()
    """Per layer, (head_dim, kv_heads) where the layers differ (Gemma 4's full-attention layers:
    ``global_head_dim``, ``num_global_key_value_heads``); empty: :attr:`head_dim` and
    :attr:`num_kv_heads` everywhere."""
    k_eq_v: bool = False
    """The full-attention layers have no ``v_proj``: their values are the key projection's
    output (Gemma 4's ``attention_k_eq_v``)."""
    logit_softcap: float | None = None
    """The logits are cap * tanh(z / cap) (``final_logit_softcapping``), or None: z."""

    def __post_init__(self):
        if self.family is None:  # specs made in code (tests, benchmarks) name only the type
            object.__setattr__(self, "family", FAMILIES[self.model_type])

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL

    def has_rope(self, i: int) -> bool:
        return self.rope_layers[i] if self.rope_layers else True

    def is_sparse(self, i: int) -> bool:
        """Whether layer ``i``'s feed-forward is the mixture of experts."""
        return self.moe is not None and (self.sparse[i] if self.sparse else True)

    def is_linear(self, i: int) -> bool:
        """Whether layer ``i`` mixes tokens with gated DeltaNet instead of softmax attention."""
        return self.layer_type(i) == LINEAR

    def head_dim_of(self, i: int) -> int:
        """Layer ``i``'s head size (Gemma 4's full-attention layers have their own)."""
        return self.attn_shapes[i][0] if self.attn_shapes else self.head_dim

    def kv_heads_of(self, i: int) -> int:
        """Layer ``i``'s key-value heads."""
        return self.attn_shapes[i][1] if self.attn_shapes else self.num_kv_heads

    def values_are_keys(self, i: int) -> bool:
        """Whether layer ``i`` takes its values from the key projection (:attr:`k_eq_v`)."""
        return self.k_eq_v and self.layer_type(i) == FULL

    def block(self, i: int) -> tuple:
        """What decides layer ``i``'s tensors (layers of one block share a :class:`Layout`)."""
        return (self.is_sparse(i), self.is_linear(i), self.head_dim_of(i), self.kv_heads_of(i),
                self.values_are_keys(i))

    # ---- layouts -------------------------------------------------------------------------
    @cached_property
    def layouts(self) -> tuple[Layout, ...]:
        """Each decoder layer's tensors, in the order of its maths (norms as the family places
        them; a mixture of experts as its router and one stacked tensor per projection).
        Layers of one :meth:`block` share one object, built once: the planner reads them
        hundreds of times per plan (rebuilding took 18% of the time of planning a small model,
        measured)."""
        built: dict[tuple, Layout] = {}
        for i in range(self.num_layers):
            if self.block(i) not in built:
                built[self.block(i)] = self._build_layout(*self.block(i))
        return tuple(built[self.block(i)] for i in range(self.num_layers))

    def layout(self, i: int) -> Layout:
        """Decoder layer ``i``'s tensors."""
        return self.layouts[i]

    @property
    def uniform(self) -> bool:
        """Every decoder layer has the same tensors."""
        return all(lay is self.layouts[0] for lay in self.layouts)

    @property
    def layer_layout(self) -> Layout:
        """The one layout of a model whose layers all have the same tensors (runtime code of
        models whose layers differ uses :meth:`layout`; the planner :attr:`largest_layout`)."""
        if not self.uniform:
            raise ValueError(f"the layers of this {self.model_type} model differ: use layout(i)")
        return self.layouts[0]

    @cached_property
    def largest_layout(self) -> Layout:
        """The largest decoder layer's layout: what a parameter slot holds, and the layer the
        planner counts per-layer buffers by."""
        return max(self.layouts, key=lambda lay: lay.numel)

    def _build_layout(self, sparse: bool, linear: bool, hd: int, nkv: int,
                      no_v: bool) -> Layout:
        h, fam = self.hidden_size, self.family
        s: list[tuple[str, tuple[int, ...]]] = []
        if fam.norm != "post":
            s.append(("input_layernorm.weight", (h,)))
        s += self.linear.shapes(h) if linear else self._attention_shapes(hd, nkv, no_v)
        s.append(("post_attention_layernorm.weight", (h,)))
        if fam.norm == "sandwich":
            s.append(("pre_feedforward_layernorm.weight", (h,)))
        s += self._ffn_shapes(sparse)
        if fam.norm != "pre":
            s.append(("post_feedforward_layernorm.weight", (h,)))
        if fam.layer_scalar:
            s.append(("layer_scalar", (1,)))
        return Layout.build(s)

    def _attention_shapes(self, hd: int, nkv: int,
                          no_v: bool) -> list[tuple[str, tuple[int, ...]]]:
        h, fam = self.hidden_size, self.family
        q, kv = self.num_heads * hd, nkv * hd
        s: list[tuple[str, tuple[int, ...]]] = []
        qkv = ((("qkv_proj", q + 2 * kv),) if fam.fused else
               (("q_proj", 2 * q if fam.attn_gate else q), ("k_proj", kv),
                *(() if no_v else (("v_proj", kv),))))
        for proj, out in qkv:
            s.append((f"self_attn.{proj}.weight", (out, h)))
            if self.qkv_bias:
                s.append((f"self_attn.{proj}.bias", (out,)))
        s.append(("self_attn.o_proj.weight", (h, q)))
        if self.o_bias:
            s.append(("self_attn.o_proj.bias", (h,)))
        if self.qk_norm:
            wq, wk = (q, kv) if self.qk_norm == "full" else (hd, hd)
            s += [("self_attn.q_norm.weight", (wq,)), ("self_attn.k_norm.weight", (wk,))]
        if fam.sinks:
            s.append(("self_attn.sinks", (self.num_heads,)))
        return s

    def _ffn_shapes(self, sparse: bool) -> list[tuple[str, tuple[int, ...]]]:
        h, m = self.hidden_size, self.family.moe if sparse else None
        if m is not None and m.gemma4:  # the dense MLP, and the experts beside it
            e, i = self.moe.experts, self.moe.width
            return [*self._ffn_shapes(False), ("post_feedforward_layernorm_1.weight", (h,)),
                    (m.router, (e, h)), ("router.scale", (h,)), ("router.per_expert_scale", (e,)),
                    ("pre_feedforward_layernorm_2.weight", (h,)),
                    (m.stacked(m.gate), (e, 2 * i, h)), (m.stacked(m.down), (e, h, i)),
                    ("post_feedforward_layernorm_2.weight", (h,))]
        if m is not None and m.gpt_oss:  # (E, in, out), gate and up one projection, biases
            e, i = self.moe.experts, self.moe.width
            return [(m.router, (e, h)), (m.router_bias, (e,)),
                    (m.stacked(m.gate), (e, h, 2 * i)), (m.bias(m.gate), (e, 2 * i)),
                    (m.stacked(m.down), (e, i, h)), (m.bias(m.down), (e, h))]
        if m is not None:
            e, i, si = self.moe.experts, self.moe.width, self.moe.shared_width
            shared = [] if m.shared is None else [
                (f"{m.shared}.gate_proj.weight", (si, h)), (f"{m.shared}.up_proj.weight", (si, h)),
                (f"{m.shared}.down_proj.weight", (h, si)), (f"{m.shared}_gate.weight", (1, h))]
            return [(m.router, (e, h)), (m.stacked(m.gate), (e, i, h)),
                    (m.stacked(m.up), (e, i, h)), (m.stacked(m.down), (e, h, i)), *shared]
        i, s = self.intermediate_size, []
        mlp = ((("gate_up_proj", (2 * i, h)),) if self.family.fused else
               (("gate_proj", (i, h)), ("up_proj", (i, h))))
        for proj, shape in (*mlp, ("down_proj", (h, i))):
            s.append((f"mlp.{proj}.weight", shape))
            if self.mlp_bias:
                s.append((f"mlp.{proj}.bias", (shape[0],)))
        return s

    def stored_names(self, local: str) -> list[str]:
        """The checkpoint names (inside a layer) that a layer tensor is stored as: itself, or
        for stacked experts one tensor per expert, in expert order."""
        m = self.family.moe
        if m is not None and not m.fused_stacked:  # GPT-OSS and Gemma 4 store them stacked
            for proj in (m.gate, m.up, m.down):
                if local == m.stacked(proj):
                    return [f"{m.experts}.{e}.{proj}.weight" for e in range(self.moe.experts)]
        return [local]

    @property
    def embed_layout(self) -> Layout:
        return Layout.build([("embed_tokens.weight", (self.vocab_size, self.hidden_size))])

    @property
    def head_layout(self) -> Layout:
        """Final norm, plus the LM head unless tied to the embedding."""
        s: list[tuple[str, tuple[int, ...]]] = [("norm.weight", (self.hidden_size,))]
        if not self.tie_word_embeddings:
            s.append(("lm_head.weight", (self.vocab_size, self.hidden_size)))
        return Layout.build(s)

    # ---- counts --------------------------------------------------------------------------
    @property
    def params_per_layer(self) -> int:
        """The largest decoder layer's parameters (a slot's size; all of them when uniform)."""
        return self.largest_layout.numel

    @property
    def layer_params(self) -> int:
        """The decoder layers' parameters, all together."""
        return sum(lay.numel for lay in self.layouts)

    @property
    def num_params(self) -> int:
        """Exact trainable parameter count (tied embeddings counted once; Gemma 4's layer
        scalars, buffers that the layouts carry but nothing trains, not counted)."""
        buffers = self.num_layers if self.family.layer_scalar else 0
        return self.layer_params + self.embed_layout.numel + self.head_layout.numel - buffers

    def _active(self, layout: Layout) -> int:
        """A layer's parameters one token computes with (all but the experts it is not
        routed to)."""
        m = self.family.moe
        if self.moe is None or m.router not in layout.names():
            return layout.numel
        experts = sum(math.prod(sh) for n, _, sh in layout.entries
                      if n.startswith(m.experts + "."))  # every expert's weights and biases
        return layout.numel - experts // self.moe.experts * (self.moe.experts - self.moe.top_k)

    @property
    def active_params_per_layer(self) -> float:
        """A decoder layer's parameters one token computes with, on average over the layers:
        what the FLOPs of a token count."""
        return sum(self._active(lay) for lay in self.layouts) / self.num_layers

    @property
    def ffn_width(self) -> int:
        """Intermediate values a token's feed-forward forms, in the widest layer: the MLP's
        width, top-k times one expert's, or (Gemma 4) both (what the planner counts activation
        memory by)."""
        def width(i: int) -> int:
            routed = self.moe.top_k * self.moe.width if self.is_sparse(i) else 0
            dense = not self.is_sparse(i) or self.family.moe.gemma4
            return routed + (self.intermediate_size if dense else 0)
        return max(width(i) for i in range(self.num_layers))

    @property
    def dense_mlp_width(self) -> int:
        """The dense gated MLP's width where some layer has one (its projections are the ones
        train.precision = "fp8" runs in FP8: kernels.fp8.PROJECTIONS), else 0: every
        feed-forward is a mixture of experts."""
        dense = any(not self.is_sparse(i) or self.family.moe.gemma4
                    for i in range(self.num_layers))
        return self.intermediate_size if dense else 0

    # The attention's sizes in the widest layer: what the planner counts activations by (Gemma
    # 4's full-attention layers are wider than its sliding ones). Cached: the planner reads
    # them per candidate shape.
    @cached_property
    def q_width(self) -> int:
        """Query values a token forms (heads x head size), in the widest layer."""
        return max(self.num_heads * self.head_dim_of(i) for i in range(self.num_layers))

    @cached_property
    def kv_width(self) -> int:
        """Key (or value) values a token forms, in the widest layer."""
        return max(self.kv_heads_of(i) * self.head_dim_of(i) for i in range(self.num_layers))

    @cached_property
    def max_head_dim(self) -> int:
        """The largest head size (what picks the attention kernel's path)."""
        return max(self.head_dim_of(i) for i in range(self.num_layers))

    @cached_property
    def kv_values_per_token(self) -> int:
        """Keys and values a KV cache holds per token, all layers together."""
        return sum(2 * self.kv_heads_of(i) * self.head_dim_of(i) for i in range(self.num_layers))

    @property
    def sparse_layers(self) -> int:
        """Layers whose feed-forward is the mixture of experts."""
        return sum(self.is_sparse(i) for i in range(self.num_layers))

    @property
    def active_params(self) -> int:
        return (self.num_params - self.layer_params
                + sum(self._active(lay) for lay in self.layouts))

    def summary(self) -> dict:
        """Plain figures for display (GUI model page, ``slideformer info``)."""
        return {"family": self.model_type, "family_title": self.family.title,
                "layers": self.num_layers, "hidden": self.hidden_size,
                "intermediate": self.moe.width if self.moe else self.intermediate_size, "heads": self.num_heads,
                "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "vocab": self.vocab_size, "parameters": self.num_params,
                "active_parameters": self.active_params,
                "experts": self.moe.experts if self.moe else None,
                "experts_per_token": self.moe.top_k if self.moe else None,
                "layer_types": _type_counts(self),
                "dtype": self.torch_dtype, "tied_embeddings": self.tie_word_embeddings}


def _type_counts(spec: ModelSpec) -> str:
    """'24 full' or '20 sliding (window 512) + 4 full', NoPE layers counted apart, full layers'
    own head size and KV heads named."""
    types = [spec.layer_type(i) for i in range(spec.num_layers)]
    parts = [f"{types.count(SLIDING)} sliding (window {spec.sliding_window})"] if SLIDING in types else []
    parts += [f"{types.count(LINEAR)} linear (gated DeltaNet)"] if LINEAR in types else []
    if FULL in types:
        i = types.index(FULL)
        own = (spec.head_dim_of(i), spec.kv_heads_of(i))  # Gemma 4's full layers differ
        parts.append(f"{types.count(FULL)} full" + (
            f" (head_dim {own[0]}, kv_heads {own[1]})"
            if own != (spec.head_dim, spec.num_kv_heads) else ""))
    nope = sum(not spec.has_rope(i) for i in range(spec.num_layers))
    return " + ".join(parts) + (f", {nope} without RoPE" if nope else "")


_FIX = FIX
# Far above any model of the supported families (the largest have ~130 layers, hidden 16384,
# vocab 256K, 512 experts); the planner and the host state allocate per layer and per row, so
# an absurd figure is refused here rather than met as a MemoryError or a search that never ends.
_LIMITS = {"hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
           "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
           "vocab_size": 1 << 24, "num_experts": 1 << 12, "num_local_experts": 1 << 12,
           "moe_intermediate_size": 1 << 20, "num_experts_per_tok": 1 << 12,
           "top_k_experts": 1 << 12, "num_global_key_value_heads": 1 << 12}


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise UserError(path, f"config.json has no '{key}'", _FIX)
    return _positive_int(cfg, key, path)


def _positive_int(cfg: dict, key: str, path: Path) -> int:
    return positive_int(cfg, key, path, _LIMITS.get(key))


def _dtype_name(cfg: dict, path: Path) -> str:
    v = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if not isinstance(v, str):
        raise UserError(path, f"'torch_dtype' is {v!r}, not a name such as \"bfloat16\"", _FIX)
    return v


def _moe_shape(fam: Family, cfg: dict, path: Path) -> MoeShape | None:
    """The experts' sizes, each checked against the others (None: no experts)."""
    m = fam.moe
    if m is None or (m.enable_key is not None and not flag(cfg, m.enable_key, path)):
        return None
    key = next((k for k in m.count_keys if cfg.get(k) is not None), m.count_keys[0])
    experts, k = _need(cfg, key, path), _need(cfg, m.top_k_key, path)
    if k > experts:
        raise UserError(path, f"routes each token to {m.top_k_key}={k} experts, but "
                        f"{key} is {experts}", f"{_FIX} (top-k is at most the expert count)")
    renorm = m.renormalise if isinstance(m.renormalise, bool) else flag(cfg, m.renormalise, path)
    clamp = {}
    if m.gpt_oss:  # GptOssConfig's defaults
        clamp = dict(alpha=positive_real(cfg, "swiglu_alpha", path, 1.702),
                     limit=positive_real(cfg, "swiglu_limit", path, 7.0))
    aux = 0.0
    if m.aux_loss and flag(cfg, "output_router_logits", path):  # (Gemma 4's LM adds none)
        aux = m.aux_default if cfg.get("router_aux_loss_coef") is None \
            else cfg["router_aux_loss_coef"]
        if isinstance(aux, bool) or not isinstance(aux, (int, float)) or not 0 <= aux < math.inf:
            raise UserError(path, f"'router_aux_loss_coef' is {aux!r}, not a number >= 0", _FIX)
    shared = _need(cfg, "shared_expert_intermediate_size", path) if m.shared else 0
    return MoeShape(experts, k, _need(cfg, m.width_key, path), renorm, aux_coef=float(aux),
                    shared_width=shared, **clamp)


def _refused(fam: Family, cfg: dict, path: Path) -> None:
    """Settings a family's maths here does not follow: refused, never approximated."""
    for key, only in fam.refuse:
        if cfg.get(key) not in (None, only):
            raise UserError(path, f"sets {key} = {cfg[key]!r}, which this engine does not "
                            f"train exactly for {fam.model_type} (it supports {only!r} only)",
                            f"set \"{key}\": {json_value(only)} in config.json to train "
                            "without it, or use another tool for this setting")


_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}
"""config.json's names for each activation a family's MLP computes."""


def _check_activation(fam: Family, cfg: dict, path: Path) -> None:
    for key in ("hidden_act", "hidden_activation"):
        v = cfg.get(key)
        if v is not None and v not in _ACTIVATIONS[fam.act]:
            raise UserError(path, f"sets {key} = {v!r}, but this engine computes "
                            f"{fam.model_type}'s MLP with {_ACTIVATIONS[fam.act][0]}",
                            "use the config.json that came with the model's weights")


def json_value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else repr(v)


def spec_from_config(cfg: dict, path: Path | str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed config.json dict."""
    path = Path(path)
    mt = cfg.get("model_type")
    if isinstance(mt, str) and mt in TEXT_TOWERS:  # a multimodal folder: its text model
        cfg = TEXT_TOWERS[mt](cfg, path)
        mt = cfg["model_type"]
    if not isinstance(mt, str) or mt not in FAMILIES:
        raise UserError(path, f"model_type {mt!r} is not supported",
                        f"choose a model of a supported family: {', '.join(SUPPORTED)} (and "
                        f"the text tower of {', '.join(TEXT_TOWERS)})")
    fam = FAMILIES[mt]
    _refused(fam, cfg, path)
    h = _need(cfg, "hidden_size", path)
    nh = _need(cfg, "num_attention_heads", path)
    nkv = _positive_int(cfg, "num_key_value_heads", path) if cfg.get("num_key_value_heads") else nh
    hd = _positive_int(cfg, "head_dim", path) if cfg.get("head_dim") is not None else h // nh
    if not hd:
        raise UserError(path, f"hidden_size={h} / num_attention_heads={nh} gives a head_dim of 0",
                        _FIX)
    if nh % nkv:
        raise UserError(path, f"num_attention_heads={nh} is not a multiple of "
                              f"num_key_value_heads={nkv}", "fix config.json")
    L = _need(cfg, "num_hidden_layers", path)
    theta, rs = rope_of(cfg, path)
    attn_bias = flag(cfg, "attention_bias", path)
    moe = _moe_shape(fam, cfg, path)
    if moe is None or fam.moe.gemma4:  # Gemma 4's experts run beside the dense MLP
        mlp = _need(cfg, "intermediate_size", path)
    else:  # a dense width an MoE config may carry (unused), else the experts'
        mlp = _positive_int(cfg, "intermediate_size", path) if cfg.get("intermediate_size") \
            else moe.width
    values = dict(
        model_type=mt, vocab_size=_need(cfg, "vocab_size", path), hidden_size=h,
        intermediate_size=mlp,
        num_layers=L, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
        rms_norm_eps=positive_real(cfg, "rms_norm_eps", path, 1e-6, below=1.0),
        rope_theta=theta, rope_scaling=rs,
        tie_word_embeddings=flag(cfg, "tie_word_embeddings", path),
        qkv_bias=fam.qkv_bias or attn_bias, o_bias=attn_bias,
        mlp_bias=flag(cfg, "mlp_bias", path), qk_norm=fam.qk_norm,
        max_position_embeddings=(_positive_int(cfg, "max_position_embeddings", path)
                                 if cfg.get("max_position_embeddings") is not None else 4096),
        sliding_window=None, torch_dtype=_dtype_name(cfg, path), raw_config=cfg, family=fam,
        layer_types=all_layers(FULL, L), moe=moe)
    if fam.configure is not None:
        values.update(fam.configure(cfg, path, L))
    check_longrope(values["rope_scaling"], values.get("rotary_dim") or hd, path)
    _check_activation(fam, cfg, path)
    if SLIDING in values["layer_types"]:
        values["sliding_window"] = values["sliding_window"] or window(cfg, path)
        if values["sliding_window"] is None:
            raise UserError(path, "'layer_types' marks sliding_attention layers, but "
                            "'sliding_window' is not set", _FIX)
    elif set(values["layer_types"]) == {FULL}:
        values["layer_types"] = ()  # all full: the plain causal path
    return ModelSpec(**values)


def load_config(model_dir: Path | str) -> dict:
    """Read ``config.json`` of a model folder, with a clear error for each way it can fail."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(model_dir, "is not a folder", "pass the folder that holds config.json")
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(path, "is missing",
                        "pick a Hugging Face model folder (config.json + *.safetensors)")
    cfg = read_json(path, "restore config.json from the model's source")
    if not isinstance(cfg, dict):
        raise UserError(path, "is not a JSON object", "restore config.json from the model's source")
    if (key := surrogate_key(cfg)) is not None:  # fails later, wherever the text is written
        raise UserError(path, f"'{key}' holds text that is not valid Unicode (a lone "
                        "surrogate escape)", "restore config.json from the model's source")
    return cfg


def load_spec(model_dir: Path | str) -> ModelSpec:
    """The :class:`ModelSpec` of a model folder (only config.json is read)."""
    return spec_from_config(load_config(model_dir), Path(model_dir) / "config.json")
