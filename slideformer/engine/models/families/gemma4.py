"""Gemma 4 text (``gemma4_text``; the text tower of the multimodal ``gemma4`` folders:
:func:`text_tower`): the dense 31B and the 26B-A4B, whose experts run beside the dense MLP.

Gemma 3's layer (gemma3.py: sandwich norms, GeGLU, per-head q/k norms, embedding x sqrt(H),
sliding layers with a local RoPE) as transformers 5.25's Gemma4TextModel changes it:

- the norms scale by the weight itself (not 1 + w), in fp32, rounded once;
- the values are RMS-normed per head without a weight, and the scores are not scaled;
- the full-attention layers have a head size and KV heads of their own: ``global_head_dim``
  (512 unless given) and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` (a config
  saved by transformers spells them as ``per_layer_config``); with ``attention_k_eq_v`` they
  have no ``v_proj``: the values are the key projection's output (before k's norm and RoPE);
- their RoPE is "proportional" (``rope_parameters`` per layer type): the first
  ``partial_rotary_factor`` of the head's frequency pairs turn as in a RoPE over the whole
  head, the others not at all (models.layers.rope_inv_freq);
- each layer's output is multiplied by its ``layer_scalar``, a fixed buffer of the checkpoint;
- the logits are soft-capped, cap * tanh(z / cap) (``final_logit_softcapping``);
- ``enable_moe_block``: experts beside the dense MLP (``Moe.gemma4``: router ``router.proj``
  on the normed residual stream, ``top_k_experts`` of ``num_experts`` renormalised and scaled
  per expert, each expert ``moe_intermediate_size`` wide); transformers' causal LM adds no
  router loss, so none is trained.

Refused, each with its config key: per-layer input embeddings (``hidden_size_per_layer_input``
> 0) and KV sharing across layers (``num_kv_shared_layers`` > 0), which only the small E2B and
E4B models use (31B and 26B-A4B set both to 0); bidirectional attention over every token
(``use_bidirectional_attention`` "all"; "vision" is causal on text). ``use_double_wide_mlp``
widens only the KV-sharing layers' MLP, so without KV sharing it changes nothing.
"""
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.models.families.base import (FIX, FULL, SLIDING, Family, Moe, count,
                                                     flag, layer_types, positive_int,
                                                     positive_real, rope_per_type, window)

TEXT_DEFAULTS = {"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216,
                 "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                 "sliding_window": 512, "tie_word_embeddings": True,
                 "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0}
"""Gemma4TextConfig's defaults (transformers 5.25) for what a config.json may leave out."""
ROPE_DEFAULT = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1000000.0}}
"""Gemma4TextConfig's ``rope_parameters`` when config.json gives none."""
LAYER_KEYS = ("head_dim", "num_key_value_heads")
"""What a ``per_layer_config`` entry may set here."""


def text_tower(cfg: dict, path: Path) -> dict:
    """The config.json of a multimodal Gemma 4 folder (``model_type`` "gemma4") as its text
    tower's: ``text_config`` over :data:`TEXT_DEFAULTS`, the folder's dtype where it gives
    none and its tying (Gemma4Config's ``tie_word_embeddings``, true by default, decides the
    head, as in transformers), as a text-only ``gemma4_text`` config (an export is a
    Gemma4ForCausalLM). The weights are read under ``model.language_model.``
    (models.weights.TOWER_PREFIXES); the vision and audio towers are neither trained nor
    written."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UserError(path, "is a multimodal Gemma 4 config.json without a 'text_config' object",
                        FIX)
    out = {**TEXT_DEFAULTS, **text}
    for key in ("torch_dtype", "dtype"):
        if key not in text and key in cfg:
            out[key] = cfg[key]
    out["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
    return out | {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"]}


def _refuse(cfg: dict, path: Path) -> None:
    """What this engine does not compute for Gemma 4, one message per config key."""
    ple = cfg.get("hidden_size_per_layer_input", TEXT_DEFAULTS["hidden_size_per_layer_input"])
    if ple:  # Gemma4TextConfig's default is 256: a config.json without the key has them
        raise UserError(path, f"sets hidden_size_per_layer_input = {ple!r} (per-layer input "
                        "embeddings, as Gemma 4 E2B and E4B have), which this engine does not "
                        "train", "train Gemma 4 31B or 26B-A4B (they have none), or use another "
                        "tool for E2B and E4B")
    if cfg.get("num_kv_shared_layers") is not None and count(cfg, "num_kv_shared_layers", path):
        raise UserError(path, f"sets num_kv_shared_layers = {cfg['num_kv_shared_layers']} (layers "
                        "that reuse earlier layers' keys and values, as Gemma 4 E2B and E4B "
                        "do), which this engine does not train", "train Gemma 4 31B or 26B-A4B "
                        "(they share none), or use another tool for E2B and E4B")
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):
        raise UserError(path, "sets use_bidirectional_attention = "
                        f"{cfg['use_bidirectional_attention']!r}, which this engine does not "
                        "train (it trains causal attention; \"vision\" is causal on text)",
                        "use the config.json that came with the model's weights, or another tool")


def _layer_overrides(cfg: dict, path: Path, types: tuple[str, ...], k_eq_v: bool) -> dict:
    """{layer: {head_dim / num_key_value_heads: value}}, as Gemma4TextConfig derives them:
    config.json's ``per_layer_config`` when it has one (what transformers saves), else
    ``global_head_dim`` (512 unless given) on every full-attention layer, with
    ``num_global_key_value_heads`` while ``attention_k_eq_v`` is on."""
    plc = cfg.get("per_layer_config")
    if plc is None:
        over = {"head_dim": positive_int(cfg, "global_head_dim", path, 1 << 12)
                if cfg.get("global_head_dim") is not None else 512}
        if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = positive_int(cfg, "num_global_key_value_heads", path)
        return {i: over for i, t in enumerate(types) if t == FULL}
    if not isinstance(plc, dict):
        raise UserError(path, f"'per_layer_config' is {plc!r}, not an object", FIX)
    out = {}
    for key, over in plc.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(types)
                and isinstance(over, dict)):
            raise UserError(path, f"per_layer_config has {key!r}: {over!r}, not a layer number "
                            f"below {len(types)} with an object of settings", FIX)
        other = sorted(set(over) - set(LAYER_KEYS))
        if other:
            raise UserError(path, f"per_layer_config sets {', '.join(other)} for layer {key}, "
                            "which this engine does not train per layer (it reads "
                            f"{' and '.join(LAYER_KEYS)})", "use another tool for this model")
        out[int(key)] = {k: positive_int(over, k, path, 1 << 12) for k in over}
    return out


def _attention_shapes(cfg: dict, path: Path, types: tuple[str, ...], k_eq_v: bool,
                      hd: int, nkv: int) -> tuple:
    """ModelSpec.attn_shapes: (head_dim, kv_heads) per layer, () where all are (hd, nkv)."""
    nh = positive_int(cfg, "num_attention_heads", path)
    over = _layer_overrides(cfg, path, types, k_eq_v)
    shapes = tuple((over.get(i, {}).get("head_dim", hd),
                    over.get(i, {}).get("num_key_value_heads", nkv)) for i in range(len(types)))
    for i, (_, kv) in enumerate(shapes):
        if nh % kv:
            raise UserError(path, f"layer {i} has {kv} key-value heads, and "
                            f"num_attention_heads={nh} is not a multiple of that", FIX)
    return () if all(s == (hd, nkv) for s in shapes) else shapes


def configure(cfg: dict, path: Path, num_layers: int) -> dict:
    _refuse(cfg, path)
    types = layer_types(cfg, path, num_layers) or tuple(
        SLIDING if (i + 1) % 6 else FULL for i in range(num_layers))
    types = types[:-1] + (FULL,)  # Gemma4TextConfig forces the last layer to full attention
    rp = cfg.get("rope_parameters")
    if rp is None:
        rp = ROPE_DEFAULT
    if not (isinstance(rp, dict) and all(isinstance(rp.get(t), dict) for t in set(types))):
        raise UserError(path, f"'rope_parameters' is {rp!r}, not an object with the RoPE of each "
                        f"layer type ({', '.join(sorted(set(types)))})", FIX)
    hd = positive_int(cfg, "head_dim", path, 1 << 12) if cfg.get("head_dim") is not None \
        else TEXT_DEFAULTS["head_dim"]
    nkv = positive_int(cfg, "num_key_value_heads", path) \
        if cfg.get("num_key_value_heads") is not None else TEXT_DEFAULTS["num_key_value_heads"]
    k_eq_v = flag(cfg, "attention_k_eq_v", path)
    cap = cfg.get("final_logit_softcapping")
    out = {"layer_types": types, **rope_per_type({"rope_parameters": rp}, path, 1e6, 1e4),
           "head_dim": hd, "num_kv_heads": nkv, "attn_scale": 1.0,
           "attn_shapes": _attention_shapes(cfg, path, types, k_eq_v, hd, nkv),
           "k_eq_v": k_eq_v,
           "sliding_window": window(cfg, path) or TEXT_DEFAULTS["sliding_window"],
           "tie_word_embeddings": flag(cfg, "tie_word_embeddings", path, default=True),
           "logit_softcap": None if cap is None else
           positive_real(cfg, "final_logit_softcapping", path, 30.0)}
    if cfg.get("max_position_embeddings") is None:
        out["max_position_embeddings"] = TEXT_DEFAULTS["max_position_embeddings"]
    return out


FAMILY = Family(
    "gemma4_text", "Gemma4ForCausalLM", "Gemma 4", norm="sandwich", qk_norm="head",
    norm_fp32=True, embed_scale=True, act="gelu_tanh", configure=configure, v_norm=True,
    layer_scalar=True,
    moe=Moe("router.proj.weight", "experts", "gate_up_proj", "gate_up_proj", "down_proj",
            ("num_experts",), "moe_intermediate_size", renormalise=True, gemma4=True,
            top_k_key="top_k_experts", enable_key="enable_moe_block", aux_loss=False),
    gguf="gemma4")
