"""Architecture spec read from a Hugging Face ``config.json``, and the flat-buffer layouts.

A decoder layer's parameters live in ONE flat buffer; each weight is a view at a fixed offset
(a :class:`Layout`). The embedding and the head (final norm + LM head) are separate items with
layouts of their own. Parameter names inside a layer are the Hugging Face names without the
``model.layers.{i}.`` prefix, so reading and writing checkpoints is a rename, not a mapping table.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UserError

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

    def shape(self, name: str) -> tuple[int, ...]:
        return next(s for n, _, s in self.entries if n == name)

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


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise UserError(path, f"config.json has no '{key}'",
                        "use the config.json that came with the model's weights")
    return _positive_int(cfg, key, path)


def _positive_int(cfg: dict, key: str, path: Path) -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UserError(path, f"'{key}' is {v!r}, not a positive integer",
                        "use the config.json that came with the model's weights")
    return v


# Keys each rope_scaling type needs (rope_inv_freq reads them).
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


def _rope_scaling(cfg: dict, path: Path) -> tuple[tuple[str, object], ...] | None:
    """The RoPE scaling of config.json as sorted items, or None for plain RoPE.

    transformers < 5 writes ``rope_scaling`` (plus ``rope_theta``); transformers >= 5 writes one
    ``rope_parameters`` dict holding both, and no ``rope_scaling``: read either spelling.
    """
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not isinstance(rs, dict):
        return None
    rs = {k: v for k, v in rs.items() if k != "rope_theta"}
    kind = rs.get("rope_type", rs.get("type"))
    if not rs or kind == "default":
        return None
    if kind not in _ROPE_KEYS:
        raise UserError(path, f"rope_scaling type {kind!r} is not supported",
                        "supported: none, linear, llama3")
    missing = [k for k in _ROPE_KEYS[kind] if not isinstance(rs.get(k), (int, float))]
    if missing:
        raise UserError(path, f"rope_scaling of type {kind!r} lacks {', '.join(missing)}",
                        "use the config.json that came with the model's weights")
    return tuple(sorted((k, v) for k, v in rs.items() if not isinstance(v, (list, dict))))


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
    hd = _positive_int(cfg, "head_dim", path) if cfg.get("head_dim") else h // nh
    if nh % nkv:
        raise UserError(path, f"num_attention_heads={nh} is not a multiple of "
                              f"num_key_value_heads={nkv}", "fix config.json")
    rs = _rope_scaling(cfg, path)
    attn_bias = bool(cfg.get("attention_bias", False))
    # The legacy "default" value of Hugging Face's RoPE parameters moved into rope_parameters
    # in recent transformers versions; accept both spellings.
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelSpec(
        model_type=mt, vocab_size=_need(cfg, "vocab_size", path), hidden_size=h,
        intermediate_size=_need(cfg, "intermediate_size", path),
        num_layers=_need(cfg, "num_hidden_layers", path), num_heads=nh,
        num_kv_heads=nkv, head_dim=hd, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta), rope_scaling=rs,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=(mt == "qwen2") or attn_bias, o_bias=attn_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=(mt == "qwen3"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        raw_config=cfg)


def load_config(model_dir: Path | str) -> dict:
    """Read ``config.json`` of a model folder, with a clear error for each way it can fail."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(model_dir, "is not a folder", "pass the folder that holds config.json")
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(path, "is missing",
                        "pick a Hugging Face model folder (config.json + *.safetensors)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(path, f"is not valid JSON ({e})", "restore config.json from the model's source") from None
    if not isinstance(cfg, dict):
        raise UserError(path, "is not a JSON object", "restore config.json from the model's source")
    return cfg


def load_spec(model_dir: Path | str) -> ModelSpec:
    """The :class:`ModelSpec` of a model folder (only config.json is read)."""
    return spec_from_config(load_config(model_dir), Path(model_dir) / "config.json")
