"""A whole model held in memory as flat per-item parameters: the dense reference path.

Used for correctness tests against Hugging Face, as the dense-training reference of the sliding
trainer, and for generation in the demo's before/after score. The sliding trainer computes the
same functions item by item.
"""
from __future__ import annotations

import torch
from torch import nn

from slideformer.engine.kernels.attention import packed_causal_mask
from slideformer.engine.kernels.linear_ce import linear_cross_entropy
from slideformer.engine.models.inputs import LayerInputs, positions_for  # noqa: F401 (re-export)
from slideformer.engine.models.layers import decoder_layer, rms_norm
from slideformer.engine.models.spec import ModelSpec


def embed(spec: ModelSpec, p: dict, ids: torch.Tensor) -> torch.Tensor:
    """Token embedding lookup: ids (B, T) -> (B, T, H), scaled where the family scales it."""
    w = p["embed_tokens.weight"]
    x = nn.functional.embedding(ids, w)
    scale = embed_scale(spec, w.dtype)
    return x if scale is None else x * scale


def embed_scale(spec: ModelSpec, dtype: torch.dtype) -> float | None:
    """Gemma's sqrt(hidden_size), rounded to the embedding's dtype as transformers multiplies
    it (its gradient is the same factor), or None."""
    if not spec.family.embed_scale:
        return None
    return torch.tensor(spec.hidden_size ** 0.5, dtype=dtype).item()


def final_norm(spec: ModelSpec, w: torch.Tensor, x: torch.Tensor,
               out: torch.dtype | None = None) -> torch.Tensor:
    """The head's RMSNorm of the last hidden states."""
    return rms_norm(x, w, spec.rms_norm_eps, out, spec.family.norm_offset, spec.family.norm_fp32)


def head_weight(spec: ModelSpec, head: dict, emb: dict) -> torch.Tensor:
    """The LM head matrix (V, H): its own, or the embedding's when tied."""
    return emb["embed_tokens.weight"] if spec.tie_word_embeddings else head["lm_head.weight"]


def lm_logits(spec: ModelSpec, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The logits h @ w.T, soft-capped to cap * tanh(z / cap) where the model says so
    (ModelSpec.logit_softcap, Gemma 4), in h's dtype as transformers computes them."""
    z = h @ w.t()
    cap = spec.logit_softcap
    return z if cap is None else torch.tanh(z / cap) * cap


class DenseModel(nn.Module):
    """All items as ``nn.Parameter`` flat buffers: embed, layers[i], head."""

    def __init__(self, spec: ModelSpec, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.spec = spec
        mk = lambda n: nn.Parameter(torch.zeros(n, dtype=dtype, device=device))  # noqa: E731
        self.embed = mk(spec.embed_layout.numel)
        self.layers = nn.ParameterList([mk(spec.layout(i).numel) for i in range(spec.num_layers)])
        self.head = mk(spec.head_layout.numel)

    def items(self):
        """(name, flat parameter, layout) in model order."""
        s = self.spec
        yield "embed", self.embed, s.embed_layout
        for i, p in enumerate(self.layers):
            yield f"layer{i}", p, s.layout(i)
        yield "head", self.head, s.head_layout

    def hidden(self, ids, doc_ids=None):
        """Final normed hidden states (B, T, H) and the LM head matrix."""
        s = self.spec
        emb = s.embed_layout.views(self.embed)
        x = embed(s, emb, ids)
        inp = LayerInputs.of_rows(s, ids, doc_ids, x.dtype, packed_causal_mask)
        for i, p in enumerate(self.layers):
            x = decoder_layer(s, s.layout(i).views(p), x, *inp.at(i))
        head = s.head_layout.views(self.head)
        return final_norm(s, head["norm.weight"], x), head_weight(s, head, emb)

    def logits(self, ids, doc_ids=None):
        h, w = self.hidden(ids, doc_ids)
        return lm_logits(self.spec, h, w)

    def loss(self, ids, labels, scale: float, doc_ids=None, chunk: int = 4096):
        """``scale`` * summed cross-entropy over labels != -100 (chunked, no full logits)."""
        h, w = self.hidden(ids, doc_ids)
        return linear_cross_entropy(h, w, labels, scale, chunk, self.spec.logit_softcap)
