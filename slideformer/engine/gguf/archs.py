"""What a GGUF architecture says beyond the keys every one has, written on export and read on
import; and the checks that refuse, before a byte is written, a model that llama.cpp would
compute otherwise than the engine and transformers do (one message naming config.json and the
key). Qwen3.5's own keys are :mod:`slideformer.engine.gguf.qwen35`.

What llama.cpp reads (its ``src/models/*.cpp`` and ``llama-model.cpp``), family by family:

- **Phi-3 / Phi-4** (``phi3``): q, k, v in one matrix (``attn_qkv``), gate and up in one
  (``ffn_up``, gate the first half); neox RoPE on the first ``rope.dimension_count``
  dimensions of a head (Phi-4-mini's partial rotary). LongRoPE is the tensors
  ``rope_factors_long.weight`` and ``rope_factors_short.weight`` (one divisor per rotated pair),
  ``rope.scaling.attn_factor`` (the cos/sin scale) and ``rope.scaling.original_context_length``.
  llama.cpp picks the long factors when its context (``n_ctx``) exceeds the original one, where
  transformers picks them when a sequence's positions do: the two agree for sequences within
  the original context run in a context no longer than it, and for any sequence past it. Its
  ``sliding_window`` is read but not applied (llama.cpp disables Phi's window), and its
  attention output and MLP take no bias.
- **OLMo 2 and OLMo 3** (both ``olmo2``): norms after attention and MLP, q/k norms over all
  heads; neox RoPE. OLMo 3's windowed layers are ``attention.sliding_window`` with
  ``attention.sliding_window_pattern`` (a flag per layer); llama.cpp gives them the full layers'
  RoPE base without scaling. The LM head is always its own matrix.
- **SmolLM3** (``smollm3``): Llama's layer (q/k rows reordered as Llama's); llama.cpp leaves
  RoPE out of every fourth layer, a rule the GGUF cannot change.
- **Gemma 4** (``gemma4``): :mod:`slideformer.engine.gguf.gemma4` (two head sizes, a layer
  pattern, proportional RoPE as ``rope_freqs``); windowed, no biases, RoPE default, linear or
  proportional on the full layers.
- **OLMoE** (``olmoe``): OLMo 2's q/k norms over all heads, Llama's pre-norm layer, experts as
  ``ffn_{gate,up,down}_exps`` sized by ``feed_forward_length``, softmax routing whose top-k
  weights llama.cpp never renormalises (OlmoeConfig's ``norm_topk_prob`` false); neox RoPE; an
  LM head of its own; as many KV heads as heads (its key norm is hidden_size wide).
- **Mixtral** (``llama``, as llama.cpp's converter writes it): Llama's attention with the experts
  as ``ffn_{gate,up,down}_exps`` and the router as ``ffn_gate_inp``; ``feed_forward_length`` is
  one expert's width. Import tells it from Llama by its ``expert_count``.

Every family: RoPE scaling that llama.cpp reads for the architecture or a refusal (linear
everywhere; Llama 3 as the ``rope_freqs`` tensor for ``llama``; LongRoPE for ``phi3``; YaRN for
the architectures whose graph turns by the context's YaRN parameters, as ``rope.scaling.type``
"yarn", ``factor``, ``original_context_length`` and, where the model's attention factor is not
llama.cpp's 0.1 ln(factor) + 1, ``attn_factor`` = their ratio); a window shorter than the
context only where llama.cpp windows the layers (``gemma3``, ``olmo2``).
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

from slideformer.engine.errors import UserError
from slideformer.engine.gguf import gemma4, metadata
from slideformer.engine.models.families.base import FULL, SLIDING
from slideformer.engine.models.layers import rope_attention_factor, rope_inv_freq
from slideformer.engine.models.spec import ModelSpec

KEEP = "keep the model in its Hugging Face folder"
ROPE_TYPES = {"llama": ("linear", "llama3", "yarn"), "phi3": ("linear", "longrope"),
              "qwen2": ("linear", "yarn"), "qwen3": ("linear", "yarn"),
              "qwen3moe": ("linear", "yarn"), "smollm3": ("linear", "yarn"),
              "olmo2": ("linear", "yarn"), "gemma4": ("linear", "proportional")}
"""The RoPE scaling types export writes for each GGUF architecture (others: linear, which every
llama.cpp graph applies through ``rope.scaling.factor``). YaRN: where llama.cpp's graph turns
every layer (OLMo 3: its full layers) by the YaRN parameters of the context. Gemma 4's full
layers: proportional RoPE (:mod:`slideformer.engine.gguf.gemma4`)."""
YARN_ARCHS = tuple(arch for arch, kinds in ROPE_TYPES.items() if "yarn" in kinds)
YARN_BETAS = (32.0, 1.0)
"""llama.cpp's YaRN beta_fast and beta_slow, fixed for these architectures (its loader reads no
other; transformers' defaults too)."""
WINDOWED = ("gemma3", "olmo2", "gemma4")
"""Architectures whose llama.cpp graph windows the layers the GGUF marks (the others attend to
the whole context)."""
NO_BIAS = ("phi3", "olmo2", "smollm3", "gemma4", "olmoe")
"""Architectures whose llama.cpp loader has no attention-output or MLP bias."""
WHOLE_HEADS = ("phi3", "olmo2", "olmoe")
"""Architectures whose llama.cpp loader sizes the query and output matrices by hidden_size
(heads x head size must equal it)."""
OWN_HEAD = ("olmo2", "olmoe")
"""Architectures whose llama.cpp loader requires ``output.weight`` (no tied LM head)."""
RENORMALISED = {"qwen3moe": True, "llama": True, "olmoe": False}
"""Whether llama.cpp's graph of each mixture-of-experts architecture renormalises the top-k
routing weights (Qwen3-MoE's and OLMoE's ``norm_topk_prob``; Mixtral always does)."""
NOPE_EVERY = 4
"""llama.cpp's SmolLM3: every fourth layer has no RoPE (``n_no_rope_layer_step``, fixed)."""
OLMO3_EVERY = 4
"""llama.cpp's olmo2 where a windowed file names no pattern: every fourth layer full."""
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


# ---- export -----------------------------------------------------------------------------------
def check(spec: ModelSpec, model_dir: Path) -> None:
    """Refuse, with one message naming config.json and the key, a model llama.cpp would load
    as another model (or not load) from the GGUF of its architecture."""
    cfg = model_dir / "config.json"
    for rule in (_check_rope, _check_window, _check_biases, _check_heads, _check_lm_head,
                 _check_nope, _check_local_rope, _check_routing):
        rule(spec, cfg)
    if _arch(spec) == gemma4.ARCH:
        gemma4.check(spec, cfg)


def _arch(spec: ModelSpec) -> str:
    return spec.family.gguf


def scaling(spec: ModelSpec) -> tuple[str | None, dict]:
    """(type, items) of the spec's RoPE scaling (type None: none)."""
    rs = dict(spec.rope_scaling or ())
    return rs.get("rope_type", rs.get("type")), rs


def _check_rope(spec: ModelSpec, cfg: Path) -> None:
    kind, rs = scaling(spec)
    allowed = ROPE_TYPES.get(_arch(spec), ("linear",))
    if kind is not None and kind not in allowed:
        key = "rope_scaling" if "rope_parameters" not in spec.raw_config else "rope_parameters"
        if isinstance(spec.raw_config.get(key), dict) and FULL in spec.raw_config[key]:
            key = f"rope_parameters.{FULL}"  # RoPE per layer type (Gemma 4)
        raise UserError(cfg, f"sets {key} of type {kind!r}, which a GGUF of llama.cpp's "
                        f"{_arch(spec)} architecture does not carry (it carries "
                        f"{', '.join(allowed)}): llama.cpp would compute another model",
                        KEEP)
    if kind == "yarn":
        _check_yarn(rs, cfg)


def _check_yarn(rs: dict, cfg: Path) -> None:
    """YaRN as llama.cpp computes it: the correction range rounded to whole dimensions
    (transformers' ``truncate``, true unless set), beta_fast 32 and beta_slow 1."""
    if rs.get("truncate", True) is not True:
        raise UserError(cfg, "sets rope_scaling.truncate = false, but llama.cpp always rounds "
                        "YaRN's correction range to whole dimensions (truncate true): it would "
                        "turn some frequency pairs at other speeds", KEEP)
    for key, fixed in zip(("beta_fast", "beta_slow"), YARN_BETAS):
        if rs.get(key) is not None and float(rs[key]) != fixed:
            raise UserError(cfg, f"sets rope_scaling.{key} = {rs[key]}, but llama.cpp's YaRN "
                            f"takes {key} {fixed:g} for this architecture: it would compute "
                            "another model", KEEP)


def _check_window(spec: ModelSpec, cfg: Path) -> None:
    if _arch(spec) in WINDOWED or SLIDING not in spec.layer_types:
        return
    if spec.sliding_window >= spec.max_position_embeddings:  # no key is ever out of reach
        return
    key = ('"use_sliding_window": false' if "use_sliding_window" in spec.raw_config
           else '"sliding_window": null')
    raise UserError(cfg, f"has sliding_window {spec.sliding_window}, shorter than "
                    f"max_position_embeddings {spec.max_position_embeddings}, but llama.cpp's "
                    f"{_arch(spec)} attends to the whole context: it would compute another "
                    "model past the window", f"{KEEP}, or set {key} in config.json if the "
                    "model is to attend to its whole context (as llama.cpp computes it)")


def _check_biases(spec: ModelSpec, cfg: Path) -> None:
    if _arch(spec) not in NO_BIAS:
        return
    for key, on in (("attention_bias", spec.o_bias or spec.qkv_bias),
                    ("mlp_bias", spec.mlp_bias)):
        if on:
            raise UserError(cfg, f"sets {key} = true, but llama.cpp's {_arch(spec)} has no "
                            "place for these biases and would not load the GGUF", KEEP)


def _check_heads(spec: ModelSpec, cfg: Path) -> None:
    if _arch(spec) in WHOLE_HEADS and spec.num_heads * spec.head_dim != spec.hidden_size:
        raise UserError(cfg, f"sets head_dim {spec.head_dim}, and {spec.num_heads} heads of it "
                        f"are not hidden_size {spec.hidden_size}, which llama.cpp's "
                        f"{_arch(spec)} sizes the attention by: it would not load the GGUF",
                        KEEP)
    if _arch(spec) == "olmoe" and spec.num_kv_heads != spec.num_heads:
        raise UserError(cfg, f"sets num_key_value_heads {spec.num_kv_heads} of "
                        f"{spec.num_heads} heads, but llama.cpp's olmoe sizes the key norm by "
                        "hidden_size (as many KV heads as heads, as OLMoE-1B-7B has): it would "
                        "not load the GGUF", KEEP)


def _check_lm_head(spec: ModelSpec, cfg: Path) -> None:
    if _arch(spec) in OWN_HEAD and spec.tie_word_embeddings:
        raise UserError(cfg, f"sets tie_word_embeddings = true, but llama.cpp's {_arch(spec)} "
                        "needs an LM head of its own (output.weight) and would not load the "
                        "GGUF", KEEP)


def _check_routing(spec: ModelSpec, cfg: Path) -> None:
    if spec.moe is None:
        return
    renorm = RENORMALISED.get(_arch(spec), True)
    if bool(spec.moe.renormalise) != renorm:  # llama.cpp's graph fixes it per architecture
        raise UserError(cfg, f"sets norm_topk_prob = {str(not renorm).lower()}, which llama.cpp's "
                        f"{_arch(spec)} does not compute (it "
                        f"{'always' if renorm else 'never'} renormalises the top-k routing "
                        "weights)", KEEP)


def _check_nope(spec: ModelSpec, cfg: Path) -> None:
    if spec.model_type != "smollm3":
        return
    rule = tuple((i + 1) % NOPE_EVERY != 0 for i in range(spec.num_layers))
    mine = tuple(spec.has_rope(i) for i in range(spec.num_layers))
    if mine != rule:
        nope = [i for i, r in enumerate(mine) if not r]
        raise UserError(cfg, f"has no RoPE in layers {nope} (no_rope_layers), but llama.cpp's "
                        f"smollm3 leaves RoPE out of every {NOPE_EVERY}th layer, whatever the "
                        "GGUF says: it would compute another model", f"{KEEP} (SmolLM3-3B's "
                        "layers follow llama.cpp's rule)")


def _check_local_rope(spec: ModelSpec, cfg: Path) -> None:
    """OLMo 3's windowed layers: llama.cpp turns them by the full layers' RoPE base, unscaled."""
    if spec.model_type != "olmo3" or SLIDING not in spec.layer_types:
        return
    theta, local_scaling = spec.local_rope
    if local_scaling is not None:
        raise UserError(cfg, "sets a RoPE scaling for the sliding_attention layers "
                        "(rope_parameters), but llama.cpp's olmo2 turns those layers unscaled",
                        KEEP)
    if theta != spec.rope_theta:
        raise UserError(cfg, f"gives the sliding_attention layers a RoPE base of {theta:g} and "
                        f"the full_attention layers {spec.rope_theta:g} (rope_parameters; "
                        "Olmo3Config gives the sliding layers 500000 unless it names theirs), "
                        "but llama.cpp's olmo2 turns both by one base", f"{KEEP}, or name both "
                        "bases in rope_parameters if they are to be equal")


def write_metadata(w: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """The keys of the architecture beyond the common ones (after :func:`check`)."""
    kind, rs = scaling(spec)
    if kind == "longrope":
        w.add_rope_scaling_attn_factors(float(rs.get("attention_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
    if kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rs["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        extra = rope_attention_factor(spec.rope_scaling) / yarn_mscale(float(rs["factor"]))
        if abs(extra - 1) > 1e-7:  # llama.cpp multiplies its own 0.1 ln(factor) + 1 by it
            w.add_rope_scaling_attn_factors(extra)
    windowed = [spec.layer_type(i) == SLIDING for i in range(spec.num_layers)]
    if _arch(spec) == "phi3" and any(windowed):  # read, not applied (the check saw to it)
        w.add_sliding_window(spec.sliding_window)
    if _arch(spec) == "olmo2" and any(windowed):
        w.add_sliding_window(spec.sliding_window)
        w.add_sliding_window_pattern(windowed)


def yarn_mscale(factor: float) -> float:
    """YaRN's cos/sin scale from its factor alone, llama.cpp's (and transformers' default)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def extra_tensors(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Tensors the GGUF holds beside the model's own (f32): llama.cpp's per-frequency RoPE
    divisors of Llama 3 scaling and of Gemma 4's proportional RoPE (``rope_freqs``), LongRoPE's
    two factor lists."""
    kind, rs = scaling(spec)
    if kind == "llama3":
        plain = rope_inv_freq(spec.head_dim, spec.rope_theta, None)
        scaled = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        return {"rope_freqs.weight": (plain / scaled).numpy().astype(np.float32)}
    if kind == "longrope":
        return {name: np.array(rs[key], np.float32)
                for name, key in zip(LONGROPE_TENSORS, ("long_factor", "short_factor"))}
    if _arch(spec) == gemma4.ARCH:
        return {gemma4.ROPE_FREQS: gemma4.rope_freqs(spec)}
    return {}


# ---- import -----------------------------------------------------------------------------------
def yarn_config(g, arch: str) -> dict:
    """``rope_scaling`` of a YaRN GGUF (llama.cpp's keys; beta_fast and beta_slow its fixed 32
    and 1, transformers' defaults): the attention factor only where the file scales llama.cpp's
    own (``rope.scaling.attn_factor``)."""
    if arch not in YARN_ARCHS:
        raise UserError(g.path, f"uses YaRN RoPE scaling in a GGUF of architecture {arch!r}, "
                        "which import does not read", "supported: none, linear (YaRN in "
                        f"{', '.join(YARN_ARCHS)})")
    factor = metadata.value(g, f"{arch}.rope.scaling.factor", float)
    old = metadata.value(g, f"{arch}.rope.scaling.original_context_length", int)
    if factor is None or factor <= 0 or old is None or old < 2:
        raise UserError(g.path, f"has YaRN RoPE scaling without a valid '{arch}.rope.scaling."
                        "factor' and 'original_context_length'", "use a complete GGUF file")
    out = {"rope_type": "yarn", "factor": _float(factor), "original_max_position_embeddings": old}
    extra = metadata.value(g, f"{arch}.rope.scaling.attn_factor", float, 1.0)
    if abs(extra - 1) > 1e-7:
        out["attention_factor"] = _float(extra * yarn_mscale(factor))
    return out


def model_type(g, arch: str, default: str) -> str:
    """The family of a GGUF whose architecture several families share: Mixtral is ``llama``
    with experts, OLMo 3 ``olmo2`` with a window."""
    if arch == "llama" and metadata.value(g, "llama.expert_count", int, 0) > 0:
        return "mixtral"
    if arch == "olmo2" and metadata.value(g, "olmo2.attention.sliding_window", int, 0) > 0:
        return "olmo3"
    return default


def config(g, arch: str, family: str, layers: int, head_dim: int, cfg: dict) -> dict:
    """The config.json ``cfg`` (read from the common keys) with the keys of the families above,
    from the metadata (and LongRoPE's tensors)."""
    if arch == "phi3":
        cfg.update(_phi3(g, arch, head_dim))
    if family == "olmo3":  # its full layers' RoPE goes into rope_parameters
        cfg.update(_olmo3(g, arch, layers, cfg.get("rope_theta", 10000.0),
                          cfg.pop("rope_scaling", None)))
    if family == "smollm3":
        cfg.update(no_rope_layer_interval=NOPE_EVERY, use_sliding_window=False)
    if arch == gemma4.ARCH:
        cfg = gemma4.config(g, arch, layers, cfg)
    return cfg


def _phi3(g, arch: str, head_dim: int) -> dict:
    """Phi-3's window (kept in config.json as the model had it), partial rotary and LongRoPE."""
    window = metadata.value(g, f"{arch}.attention.sliding_window", int)
    out: dict = {"sliding_window": window or None}
    rotary = metadata.value(g, f"{arch}.rope.dimension_count", int, head_dim)
    if rotary != head_dim:
        factor = rotary / head_dim
        if not (0 < rotary < head_dim and rotary % 2 == 0 and int(head_dim * factor) == rotary):
            raise UserError(g.path, f"rotates {rotary} of head_dim {head_dim} dimensions "
                            f"('{arch}.rope.dimension_count'), not an even share of a head that "
                            "partial_rotary_factor can state", "use a consistent GGUF file")
        out["partial_rotary_factor"] = factor
    if not any(t in g.tensors for t in LONGROPE_TENSORS):
        return out
    factors = [_factors(g, name, rotary // 2) for name in LONGROPE_TENSORS]
    old = metadata.value(g, f"{arch}.rope.scaling.original_context_length", int)
    if old is None or old < 2:
        raise UserError(g.path, f"has LongRoPE factors without a valid "
                        f"'{arch}.rope.scaling.original_context_length'",
                        "use a complete GGUF file")
    rope = {"rope_type": "longrope", "long_factor": factors[0], "short_factor": factors[1]}
    attn = metadata.value(g, f"{arch}.rope.scaling.attn_factor", float, 1.0)
    context = metadata.value(g, f"{arch}.context_length", int, old)
    if abs(attn - _attention_factor(context, old)) > 1e-6:  # Phi3Config derives the default
        rope["attention_factor"] = _float(attn)
    return {**out, "original_max_position_embeddings": old, "rope_scaling": rope}


def _attention_factor(context: int, old: int) -> float:
    """LongRoPE's default cos/sin scale (transformers' rule, from the two context lengths)."""
    factor = context / old
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))


def _factors(g, name: str, pairs: int) -> list[float]:
    """A LongRoPE factor tensor as config.json's list (the float32 values as their shortest
    decimals). A header read without tensor data (model listing) gives ones: only the shapes
    matter there, and import reads the file."""
    if name not in g.tensors or g.shape(name) != (pairs,):
        raise UserError(g.path, f"has no {name} of {pairs} numbers (one per rotated pair)",
                        "use a complete GGUF file")
    if not hasattr(g, "tensor"):
        return [1.0] * pairs
    values = np.asarray(g.tensor(name), np.float32).reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise UserError(g.path, f"has {name} with values that are not positive numbers",
                        "use another GGUF file of the model: these values are corrupt")
    return [float(np.format_float_positional(v, unique=True)) for v in values]


def _float(v: float) -> float:
    return float(f"{float(v):.7g}")


def _olmo3(g, arch: str, layers: int, theta: float, full_scaling: dict | None) -> dict:
    """OLMo 3's window and layer types (llama.cpp's rule: a flag per layer, else every n-th
    layer full, n = 4 unless the key is a number), both layer types turned by the file's one
    RoPE base and only the full layers scaled (as llama.cpp computes them)."""
    key = f"{arch}.attention.sliding_window_pattern"
    if isinstance(g.get(key), int) or g.get(key) is None:
        every = metadata.value(g, key, int, OLMO3_EVERY)  # 0: every layer windowed
        if every < 0:
            raise UserError(g.path, f"has '{key}' = {every}", "use a consistent GGUF file")
        flags = [every == 0 or i % every < every - 1 for i in range(layers)]
    else:
        flags = metadata.array(g, key, bool)
    if metadata.length(flags) < layers:
        raise UserError(g.path, f"flags {metadata.length(flags)} layers in '{key}' for its "
                        f"{layers} layers", "use a consistent GGUF file")
    default = {"rope_type": "default", "rope_theta": theta}
    return {"sliding_window": metadata.value(g, f"{arch}.attention.sliding_window", int),
            "layer_types": [SLIDING if f else FULL for f in flags[:layers]],
            "rope_parameters": {FULL: {**default, **(full_scaling or {})}, SLIDING: default}}


def extra_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The tensors beside the model's own that import expects in the file, with their shapes
    (LongRoPE's factors, Gemma 4's rope_freqs; Llama 3's rope_freqs is refused before)."""
    if _arch(spec) == gemma4.ARCH:
        return gemma4.extra_shapes(spec)
    kind, rs = scaling(spec)
    if kind != "longrope":
        return {}
    return {name: (len(rs[key]),) for name, key in zip(LONGROPE_TENSORS,
                                                         ("long_factor", "short_factor"))}
