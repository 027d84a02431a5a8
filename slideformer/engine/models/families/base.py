"""What a model family is: a declarative list of its differences from the Llama decoder layer.

Every family here is one instance of :class:`Family` in a file of its own (``llama.py``,
``gemma3.py``, ...). A decoder layer is attention and a feed-forward, each wrapped in RMSNorms
whose placement the family names (:attr:`Family.norm`); the attention may add biases, per-head or
whole-width q/k norms, a scale of its own, a sliding window on the layers ``layer_types`` marks,
per-layer-type RoPE or none (NoPE layers); the feed-forward is a gated MLP or a mixture of
experts (:class:`Moe`). config.json is read into these values by
``models.spec.spec_from_config``, plus the family's own ``configure`` hook where its config
spells something its own way: only the families whose transformers code reads ``layer_types``
read it here (Llama's ignores it, Mistral windows every layer by ``sliding_window``).

Adding a family: a file with its ``FAMILY = Family(...)`` (and a ``configure`` when its
config.json needs one), its line in ``families/__init__.py``, and its tiny config in
``models/tiny.py``; the tests against transformers pick it up from ``SUPPORTED``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slideformer.engine.errors import UserError

FIX = "use the config.json that came with the model's weights"
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
"""The layer types of transformers' ``layer_types`` (LINEAR: Qwen3.5's gated DeltaNet)."""


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts feed-forward: its tensor names and how its router combines experts.

    The experts of a layer are stored stacked: one (E, out, in) tensor per projection, named
    ``{experts}.{proj}.weight`` inside the engine, and written as E tensors
    ``{experts}.{e}.{proj}.weight`` in Hugging Face checkpoints (their on-disk names)."""

    router: str
    """The router's weight (E, H), e.g. "mlp.gate.weight"."""
    experts: str
    """The experts' name prefix, e.g. "mlp.experts"."""
    gate: str
    up: str
    down: str
    """The projections' names under the prefix (Mixtral: w1, w3, w2)."""
    count_keys: tuple[str, ...]
    """config.json's names for the number of experts, the first present counts (Qwen3-MoE
    writes "num_experts", transformers 5 saves it as "num_local_experts", Mixtral's name)."""
    width_key: str
    """config.json's width of one expert ("moe_intermediate_size"; Mixtral: "intermediate_size")."""
    renormalise: bool | str
    """Whether the top-k routing weights are renormalised to sum to 1: always (True), or as
    the config key of that name says (Qwen3-MoE's "norm_topk_prob")."""
    gpt_oss: bool = False
    """GPT-OSS's experts, which differ in five ways: the router and every expert projection
    carry biases (``{router}`` -> ``.bias``, ``{experts}.{proj}_bias``); gate and up are one
    projection ``gate`` whose outputs interleave (gate at even columns, up at odd); the stacked
    tensors are stored (E, in, out), under their own names without ``.weight``, stacked on
    disk too; the router takes the top-k logits and softmaxes those; the activation is the
    clamped SwiGLU of :func:`slideformer.engine.models.moe.clamped_swiglu` (``swiglu_alpha``,
    ``swiglu_limit``)."""

    shared: str | None = None
    """The prefix of a shared expert every token goes through beside its routed ones, a gated
    MLP of ``shared_expert_intermediate_size`` scaled per token by sigmoid of
    ``{shared}_gate.weight`` (1, H) (Qwen3.5-MoE: "mlp.shared_expert"); None: none."""
    gemma4: bool = False
    """Gemma 4's experts, which run beside the layer's dense MLP (models.moe.beside_mlp): the
    router reads the residual stream through an RMSNorm without weight, scaled by
    ``router.scale`` (H,) and 1/sqrt(H), and multiplies each token's renormalised top-k
    weights by ``router.per_expert_scale`` (E,); the experts read
    ``pre_feedforward_layernorm_2`` of the stream; gate and up are one projection ``gate``
    (gate its first half of the outputs, up the second), stored (E, out, in) under their own
    names without ``.weight``, stacked on disk too; the experts' output is normed by
    ``post_feedforward_layernorm_2`` and added to the MLP's, normed by
    ``post_feedforward_layernorm_1``."""
    top_k_key: str = "num_experts_per_tok"
    """config.json's number of experts per token (Gemma 4: "top_k_experts")."""
    enable_key: str | None = None
    """A config.json flag that switches the experts on (Gemma 4: "enable_moe_block"; off: a
    dense model); None: always on."""
    aux_loss: bool = True
    """The causal LM adds the router's load-balancing loss while ``output_router_logits`` is
    on (Gemma 4's does not)."""
    aux_default: float = 0.001
    """Its weight where config.json gives no ``router_aux_loss_coef`` (MixtralConfig's and
    Qwen3MoeConfig's default; OlmoeConfig's is 0.01)."""

    def stacked(self, proj: str) -> str:
        return f"{self.experts}.{proj}" + ("" if self.fused_stacked else ".weight")

    @property
    def fused_stacked(self) -> bool:
        """The experts are stored stacked on disk, gate and up in one tensor, under their own
        names (GPT-OSS, Gemma 4)."""
        return self.gpt_oss or self.gemma4

    def bias(self, proj: str) -> str:
        """An expert projection's stacked bias (GPT-OSS)."""
        return f"{self.experts}.{proj}_bias"

    @property
    def router_bias(self) -> str | None:
        return self.router.removesuffix("weight") + "bias" if self.gpt_oss else None


@dataclass(frozen=True)
class DeltaNetShape:
    """The sizes of a gated DeltaNet layer (Qwen3.5's ``linear_*`` keys of config.json)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    """The gated output norm's epsilon (``rms_norm_eps``)."""

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def shapes(self, h: int) -> list[tuple[str, tuple[int, ...]]]:
        """The layer's token-mixer tensors (transformers' ``linear_attn`` names)."""
        a, nv = "linear_attn.", self.num_v_heads
        return [(a + "in_proj_qkv.weight", (self.conv_dim, h)),
                (a + "in_proj_z.weight", (self.value_dim, h)),
                (a + "in_proj_b.weight", (nv, h)), (a + "in_proj_a.weight", (nv, h)),
                (a + "conv1d.weight", (self.conv_dim, 1, self.conv_kernel)),
                (a + "dt_bias", (nv,)), (a + "A_log", (nv,)),
                (a + "norm.weight", (self.head_v_dim,)),
                (a + "out_proj.weight", (h, self.value_dim))]


@dataclass(frozen=True)
class Family:
    """One model family: its ``model_type`` and how its layer differs from Llama's."""

    model_type: str
    hf_class: str
    """transformers' causal-LM class (the ``architectures`` of a config.json)."""
    title: str
    """The family's name as people say it (the app's model page)."""
    norm: str = "pre"
    """RMSNorm placement: "pre" (Llama: before attention and MLP), "post" (OLMo 2: on the
    outputs of attention and MLP, before the residual add), "sandwich" (Gemma: both)."""
    qk_norm: str | None = None
    """RMSNorm of q and k: None, "head" (per head over head_dim: Qwen3, Gemma 3), or "full"
    (over all heads at once, before the heads split: OLMo 2)."""
    qkv_bias: bool = False
    """q/k/v projections carry biases whatever ``attention_bias`` says (Qwen2)."""
    norm_offset: float = 0.0
    """The norms scale by (offset + weight): Gemma stores weight - 1 (offset 1)."""
    embed_scale: bool = False
    """The embedding is multiplied by sqrt(hidden_size) (Gemma)."""
    act: str = "silu"
    """The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    moe: Moe | None = None
    """The feed-forward is a mixture of experts (every layer), or None: a gated MLP."""
    fused: bool = False
    """q, k, v are one projection ``self_attn.qkv_proj`` and gate, up one ``mlp.gate_up_proj``
    (Phi-3), split after the matmul."""
    configure: Callable[[dict, Path, int], dict] | None = field(default=None, compare=False)
    """``configure(cfg, path, num_layers)`` -> ModelSpec field overrides for what this family's
    config.json spells its own way (layer types, NoPE layers, RoPE per layer type)."""
    refuse: tuple[tuple[str, object], ...] = ()
    """(config key, the only value trained exactly): any other value is refused."""
    gguf: str | None = None
    """llama.cpp's ``general.architecture`` for this family, where GGUF import and export are
    supported (None: refused with a message)."""
    chat_template: str | None = None
    """The family's chat format, for imports whose file carries none (Gemma 3's GGUFs)."""
    sinks: bool = False
    """Each attention head has a learnt sink logit ``self_attn.sinks`` (GPT-OSS): one more
    entry of the softmax's denominator whose value is zero (kernels.attention.attend)."""
    attn_gate: bool = False
    """``q_proj`` also gives a per-head output gate (Qwen3.5: each head's [query | gate]);
    the attention's output is multiplied by sigmoid(gate) before ``o_proj``."""
    linear: bool = False
    """``layer_types`` may mark layers "linear_attention": gated DeltaNet instead of softmax
    attention (Qwen3.5; models.deltanet)."""
    norm_fp32: bool = False
    """The norms scale in fp32 and round once, as transformers' Gemma norms do (implied by
    ``norm_offset`` 1; Gemma 4's norms scale by the weight itself)."""
    v_norm: bool = False
    """The values are RMS-normed per head, without a weight (Gemma 4)."""
    layer_scalar: bool = False
    """Each layer's output is multiplied by its ``layer_scalar`` (1,), read from the checkpoint
    (Gemma 4: a buffer in transformers, not a parameter: never trained here either)."""


# ---- config.json readers shared by the families --------------------------------------------
def positive_int(cfg: dict, key: str, path: Path, limit: int | None = None) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UserError(path, f"'{key}' is {v!r}, not a positive integer", FIX)
    if limit is not None and v > limit:
        raise UserError(path, f"'{key}' is {v:,}, more than any model of the supported "
                        f"families has (at most {limit:,})", FIX)
    return v


def positive_real(cfg: dict, key: str, path: Path, default: float, below: float = math.inf) -> float:
    v = default if cfg.get(key) is None else cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < below:
        rule = "a positive number" if below == math.inf else f"a number in (0, {below:g})"
        raise UserError(path, f"'{key}' is {v!r}, not {rule}", FIX)
    return float(v)


def flag(cfg: dict, key: str, path: Path, default: bool = False) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise UserError(path, f"'{key}' is {v!r}, not true or false", FIX)
    return v


def count(cfg: dict, key: str, path: Path) -> int:
    """A non-negative integer of config.json."""
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UserError(path, f"'{key}' is {v!r}, not a whole number >= 0", FIX)
    return v


def layer_types(cfg: dict, path: Path, num_layers: int,
                known: tuple[str, ...] = (FULL, SLIDING)) -> tuple[str, ...] | None:
    """config.json's ``layer_types`` checked (one of the ``known`` types per layer), or None
    if absent."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise UserError(path, f"'layer_types' is {types!r}, not a list of names such as "
                        '"full_attention"', FIX)
    if len(types) != num_layers:
        raise UserError(path, f"'layer_types' names {len(types)} layers, but "
                        f"num_hidden_layers is {num_layers}", FIX)
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise UserError(path, f"'layer_types' holds {', '.join(map(repr, unknown))}, a layer "
                        "type this engine does not train for this family (it knows "
                        f"{' and '.join(known)})", "use a model of a supported family")
    return tuple(types)


def window(cfg: dict, path: Path) -> int | None:
    """config.json's ``sliding_window`` (a positive integer), or None when it is unset."""
    # 0 is refused, not read as unset: Gemma 3 would silently get its default window instead
    return positive_int(cfg, "sliding_window", path) if cfg.get("sliding_window") is not None \
        else None


def all_layers(kind: str, num_layers: int) -> tuple[str, ...]:
    return (kind,) * num_layers


# Keys each rope_scaling type needs (rope_inv_freq reads them).
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"),
              "proportional": (),
              "longrope": ("original_max_position_embeddings",)}
_OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"),
             "proportional": ("factor", "partial_rotary_factor"),
             "longrope": ("factor", "attention_factor")}
"""Optional numbers of a rope_scaling type (positive where given; transformers' defaults
otherwise). Gemma 4's "proportional" RoPE: models.layers.rope_inv_freq."""


def rope_of(cfg: dict, path: Path, default_theta: float = 10000.0
            ) -> tuple[float, tuple[tuple[str, object], ...] | None]:
    """(theta, scaling as sorted items or None) of a config dict.

    transformers < 5 writes ``rope_scaling`` (plus ``rope_theta``); transformers >= 5 writes one
    ``rope_parameters`` dict holding both, and no ``rope_scaling``: read either spelling. A
    ``rope_parameters`` per layer type (Gemma 3 in transformers >= 5) gives the full layers'.
    """
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get(FULL), dict):
        cfg = {"rope_parameters": rp[FULL]}
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise UserError(path, f"'{key}' is {cfg[key]!r}, not an object", FIX)
    theta = positive_real(cfg if cfg.get("rope_theta") is not None else
                          cfg.get("rope_parameters") or {}, "rope_theta", path, default_theta)
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rs = {k: v for k, v in (cfg.get(key) or {}).items() if k != "rope_theta"}
    kind = rs.get("rope_type", rs.get("type"))
    if not rs or kind == "default":
        return theta, None
    if kind == "su":  # early Phi-3 releases' name of LongRoPE (transformers' Phi3Config)
        rs, kind = {**rs, "rope_type": "longrope"}, "longrope"
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        raise UserError(path, f"{key} type {kind!r} is not supported",
                        "supported: none, linear, llama3, yarn, proportional, longrope")
    if kind == "longrope":
        rs = _longrope(cfg, rs, key, path)
    missing = [k for k in _ROPE_KEYS[kind] if isinstance(rs.get(k), bool)
               or not isinstance(rs.get(k), (int, float)) or not 0 < rs[k] < math.inf]
    missing += [k for k in _OPTIONAL.get(kind, ()) if rs.get(k) is not None and (
        isinstance(rs[k], bool) or not isinstance(rs[k], (int, float))
        or not 0 < rs[k] < math.inf)]
    if kind == "proportional" and rs.get("partial_rotary_factor", 1.0) > 1.0:
        raise UserError(path, f"{key}.partial_rotary_factor is {rs['partial_rotary_factor']!r}, "
                        "more than the whole head", FIX)
    if kind == "yarn":
        if not isinstance(rs.get("truncate", True), bool):
            raise UserError(path, f"{key}.truncate is {rs['truncate']!r}, not true or false", FIX)
    if missing:
        raise UserError(path, f"{key} of type {kind!r} lacks a positive "
                        f"{', '.join(missing)}", FIX)
    return theta, tuple(sorted((k, v) for k, v in rs.items()
                               if v is not None and not isinstance(v, (list, dict))))


def _longrope(cfg: dict, rs: dict, key: str, path: Path) -> dict:
    """LongRoPE (Ding et al. 2024; Phi-3 and Phi-4 configs), as transformers computes it: the
    frequencies are divided by ``short_factor`` (one number per rotated pair) while a forward's
    positions stay within ``original_max_position_embeddings`` and by ``long_factor`` past
    it; the tables scale by ``attention_factor``, else sqrt(1 + ln f / ln original) with f =
    ``factor`` or max_position_embeddings / original. A top-level
    ``original_max_position_embeddings`` (Phi-3's spelling) wins over the dict's, which
    defaults to max_position_embeddings. The factor
    lists become tuples (a spec is hashable); their length is checked against the rotated
    dimensions in :func:`check_longrope`."""
    rs = {k: v for k, v in rs.items() if k != "type"} | {"rope_type": "longrope"}
    if cfg.get("original_max_position_embeddings") is not None:
        rs["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    rs.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    for name in ("short_factor", "long_factor"):
        v = rs.get(name)
        if not isinstance(v, list) or not v or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf
                for x in v):
            raise UserError(path, f"{key}.{name} is {str(v)[:60]}, not a list of positive "
                            "numbers (LongRoPE needs one per rotated pair of dimensions)", FIX)
        rs[name] = tuple(float(x) for x in v)
    old = rs.get("original_max_position_embeddings")
    if isinstance(old, bool) or not isinstance(old, int) or old < 2:
        raise UserError(path, f"LongRoPE's original_max_position_embeddings is {old!r}, not an "
                        "integer of at least 2", FIX)
    if rs.get("attention_factor") is None:
        factor = rs.get("factor")
        if factor is None:
            factor = positive_int(cfg, "max_position_embeddings", path) / old \
                if cfg.get("max_position_embeddings") is not None else 1.0
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0:
            rs["attention_factor"] = 1.0 if factor <= 1 else \
                math.sqrt(1 + math.log(factor) / math.log(old))
    return rs


def rotary_dims(cfg: dict, path: Path, head_dim: int, default: float = 1.0) -> int | None:
    """The dimensions of a head RoPE turns, ``int(head_dim * partial_rotary_factor)`` as
    transformers computes them (the factor in ``rope_parameters`` or at the top level), or
    None when it is the whole head."""
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = positive_real(rope if "partial_rotary_factor" in rope else cfg,
                           "partial_rotary_factor", path, default, below=1.0 + 1e-9)
    rotary = int(head_dim * factor)  # transformers' rule
    if rotary < 2 or rotary % 2:
        raise UserError(path, f"partial_rotary_factor {factor:g} of head_dim {head_dim} rotates "
                        f"{rotary} dimensions, not an even number of at least 2", FIX)
    return rotary if rotary < head_dim else None


def check_longrope(scaling, rotary: int, path: Path) -> None:
    """LongRoPE's factor lists hold one number per rotated pair of dimensions."""
    rs = dict(scaling or ())
    if rs.get("rope_type") != "longrope":
        return
    for name in ("short_factor", "long_factor"):
        if len(rs[name]) != rotary // 2:
            raise UserError(path, f"rope_scaling.{name} has {len(rs[name])} numbers, but "
                            f"RoPE turns {rotary // 2} pairs of dimensions", FIX)


def rope_per_type(cfg: dict, path: Path, full_theta: float, local_theta: float) -> dict:
    """ModelSpec fields of a family whose sliding layers have a RoPE of their own: transformers
    >= 5 writes ``rope_parameters`` per layer type; older configs ``rope_theta`` (+
    ``rope_scaling``) for the full layers and ``rope_local_base_freq`` for the sliding ones."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and (FULL in rp or SLIDING in rp):
        for key in (FULL, SLIDING):
            if not isinstance(rp.get(key) or {}, dict):
                raise UserError(path, f"rope_parameters.{key} is {rp[key]!r}, not an object", FIX)
        full = rope_of({"rope_parameters": rp.get(FULL) or {}}, path, full_theta)
        local = rope_of({"rope_parameters": rp.get(SLIDING) or {}}, path, local_theta)
    else:
        full = rope_of(cfg, path, full_theta)
        local = (positive_real(cfg, "rope_local_base_freq", path, local_theta), None)
    return {"rope_theta": full[0], "rope_scaling": full[1], "local_rope": local}
