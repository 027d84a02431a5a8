"""Architecture spec read from a Hugging Face ``config.json``, and the flat-buffer layouts.

A decoder layer's parameters live in ONE flat buffer; each weight is a view at a fixed offset
(a :class:`Layout`). The embedding and the head (final norm + LM head) are separate items with
layouts of their own. Parameter names inside a layer are the Hugging Face names without the
``model.layers.{i}.`` prefix, so reading and writing checkpoints is a rename, not a mapping table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slideformer.engine.errors import UserError
from slideformer.engine.jsonfile import read_json, surrogate_key

if TYPE_CHECKING:  # spec reading needs no torch: ``info`` and ``plan`` start without it
    import torch

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


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
        """(name, offset, length) of the RMSNorm weights."""
        return [(n, o, s[0]) for n, o, s in self.entries if n.endswith("norm.weight")]

    def no_decay_mask(self) -> list[tuple[int, int]]:
        """(offset, numel) spans excluded from weight decay: norms and biases (1-D tensors)."""
        return [(o, math.prod(s)) for _, o, s in self.entries if len(s) == 1]


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about a decoder-only model."""

    model_type: str
    """Hugging Face ``model_type`` (one of SUPPORTED)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
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
    qk_norm: bool
    """Per-head RMSNorm on q and k (qwen3)."""
    max_position_embeddings: int
    sliding_window: int | None
    """Attention window of the layers config.json makes windowed (Mistral's ``sliding_window``;
    Qwen2/3's ``use_sliding_window`` with ``max_window_layers``; ``layer_types``), None if none.
    Not implemented: :func:`check_window` refuses sequences longer than it."""
    torch_dtype: str
    """Checkpoint dtype declared in config.json (for display and export)."""
    raw_config: dict = field(compare=False, hash=False, repr=False)
    """The config.json as read, written back unchanged on export."""

    # ---- layouts -------------------------------------------------------------------------
    @property
    def layer_layout(self) -> Layout:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        s: list[tuple[str, tuple[int, ...]]] = [("input_layernorm.weight", (h,))]
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            s.append((f"self_attn.{proj}.weight", (out, h)))
            if self.qkv_bias:
                s.append((f"self_attn.{proj}.bias", (out,)))
        s.append(("self_attn.o_proj.weight", (h, q)))
        if self.o_bias:
            s.append(("self_attn.o_proj.bias", (h,)))
        if self.qk_norm:
            s += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
        s.append(("post_attention_layernorm.weight", (h,)))
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            s.append((f"mlp.{proj}.weight", shape))
            if self.mlp_bias:
                s.append((f"mlp.{proj}.bias", (shape[0],)))
        return Layout.build(s)

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
        return self.layer_layout.numel

    @property
    def num_params(self) -> int:
        """Exact trainable parameter count (tied embeddings counted once)."""
        return (self.num_layers * self.params_per_layer + self.embed_layout.numel
                + self.head_layout.numel)

    def summary(self) -> dict:
        """Plain figures for display (GUI model page, ``slideformer info``)."""
        return {"family": self.model_type, "layers": self.num_layers, "hidden": self.hidden_size,
                "intermediate": self.intermediate_size, "heads": self.num_heads,
                "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "vocab": self.vocab_size, "parameters": self.num_params,
                "dtype": self.torch_dtype, "tied_embeddings": self.tie_word_embeddings}


_FIX = "use the config.json that came with the model's weights"
# Far above any model of the supported families (the largest have ~130 layers, hidden 16384,
# vocab 256K); the planner and the host state allocate per layer and per row, so an absurd
# figure is refused here rather than met as a MemoryError or a search that never ends.
_LIMITS = {"hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
           "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
           "vocab_size": 1 << 24}


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise UserError(path, f"config.json has no '{key}'", _FIX)
    return _positive_int(cfg, key, path)


def _positive_int(cfg: dict, key: str, path: Path) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UserError(path, f"'{key}' is {v!r}, not a positive integer", _FIX)
    if v > _LIMITS.get(key, v):
        raise UserError(path, f"'{key}' is {v:,}, more than any model of the supported "
                        f"families has (at most {_LIMITS[key]:,})", _FIX)
    return v


def _positive_real(cfg: dict, key: str, path: Path, default: float, below: float = math.inf) -> float:
    v = default if cfg.get(key) is None else cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < below:
        rule = "a positive number" if below == math.inf else f"a number in (0, {below:g})"
        raise UserError(path, f"'{key}' is {v!r}, not {rule}", _FIX)
    return float(v)


def _dtype_name(cfg: dict, path: Path) -> str:
    v = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if not isinstance(v, str):
        raise UserError(path, f"'torch_dtype' is {v!r}, not a name such as \"bfloat16\"", _FIX)
    return v


def _flag(cfg: dict, key: str, path: Path) -> bool:
    v = cfg.get(key)
    if v is not None and not isinstance(v, bool):
        raise UserError(path, f"'{key}' is {v!r}, not true or false", _FIX)
    return bool(v)


# Keys each rope_scaling type needs (rope_inv_freq reads them).
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


def _rope_scaling(cfg: dict, path: Path) -> tuple[tuple[str, object], ...] | None:
    """The RoPE scaling of config.json as sorted items, or None for plain RoPE.

    transformers < 5 writes ``rope_scaling`` (plus ``rope_theta``); transformers >= 5 writes one
    ``rope_parameters`` dict holding both, and no ``rope_scaling``: read either spelling.
    """
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise UserError(path, f"'{key}' is {cfg[key]!r}, not an object", _FIX)
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rs = cfg.get(key)
    if not rs:
        return None
    rs = {k: v for k, v in rs.items() if k != "rope_theta"}
    kind = rs.get("rope_type", rs.get("type"))
    if not rs or kind == "default":
        return None
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        raise UserError(path, f"{key} type {kind!r} is not supported",
                        "supported: none, linear, llama3")
    missing = [k for k in _ROPE_KEYS[kind] if isinstance(rs.get(k), bool)
               or not isinstance(rs.get(k), (int, float)) or not 0 < rs[k] < math.inf]
    if missing:
        raise UserError(path, f"{key} of type {kind!r} lacks a positive "
                        f"{', '.join(missing)}", _FIX)
    return tuple(sorted((k, v) for k, v in rs.items() if not isinstance(v, (list, dict))))


def _sliding_window(cfg: dict, mt: str, num_layers: int, path: Path) -> int | None:
    """The window of config.json's windowed layers as transformers reads it, or None."""
    if not cfg.get("sliding_window"):
        return None
    window = _positive_int(cfg, "sliding_window", path)
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise UserError(path, f"'layer_types' is {types!r}, not a list of names such as "
                            '"full_attention"', _FIX)
        return window if "sliding_attention" in types else None
    if mt == "mistral":
        return window
    if mt in ("qwen2", "qwen3") and _flag(cfg, "use_sliding_window", path):
        # layers from this index on are windowed
        first = (num_layers if cfg.get("max_window_layers") is None else
                 _count(cfg, "max_window_layers", path))
        return window if first < num_layers else None
    return None


def _count(cfg: dict, key: str, path: Path) -> int:
    """A non-negative integer of config.json."""
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UserError(path, f"'{key}' is {v!r}, not a whole number >= 0", _FIX)
    return v


def check_window(spec: "ModelSpec", seq_len: int, path: Path | str) -> None:
    """Refuse sequences longer than a windowed model's attention window: attention here is full
    causal, which equals windowed attention only up to the window's length."""
    if spec.sliding_window is not None and seq_len > spec.sliding_window:
        raise UserError(Path(path) / "config.json",
                        f"makes attention windowed (sliding_window={spec.sliding_window}), which "
                        f"this engine does not implement; sequences of {seq_len} tokens would "
                        f"train a different model", f"set data.max_seq_len to at most "
                        f"{spec.sliding_window} (within the window, full attention is the same)")


def spec_from_config(cfg: dict, path: Path | str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed config.json dict."""
    path = Path(path)
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise UserError(path, f"model_type {mt!r} is not supported",
                        f"choose a model of a supported family: {', '.join(SUPPORTED)}")
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
    rs = _rope_scaling(cfg, path)
    attn_bias = _flag(cfg, "attention_bias", path)
    # The legacy "default" value of Hugging Face's RoPE parameters moved into rope_parameters
    # in recent transformers versions; accept both spellings.
    theta = _positive_real(cfg if cfg.get("rope_theta") is not None else
                           cfg.get("rope_parameters") or {}, "rope_theta", path, 10000.0)
    return ModelSpec(
        model_type=mt, vocab_size=_need(cfg, "vocab_size", path), hidden_size=h,
        intermediate_size=_need(cfg, "intermediate_size", path),
        num_layers=_need(cfg, "num_hidden_layers", path), num_heads=nh,
        num_kv_heads=nkv, head_dim=hd,
        rms_norm_eps=_positive_real(cfg, "rms_norm_eps", path, 1e-6, below=1.0),
        rope_theta=theta, rope_scaling=rs,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", path),
        qkv_bias=(mt == "qwen2") or attn_bias, o_bias=attn_bias,
        mlp_bias=_flag(cfg, "mlp_bias", path), qk_norm=(mt == "qwen3"),
        max_position_embeddings=(_positive_int(cfg, "max_position_embeddings", path)
                                 if cfg.get("max_position_embeddings") is not None else 4096),
        sliding_window=_sliding_window(cfg, mt, _need(cfg, "num_hidden_layers", path), path),
        torch_dtype=_dtype_name(cfg, path), raw_config=cfg)


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
