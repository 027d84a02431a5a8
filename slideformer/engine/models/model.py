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
from slideformer.engine.models.layers import decoder_layer, rms_norm, rope_tables
from slideformer.engine.models.spec import ModelSpec


def embed(spec: ModelSpec, p: dict, ids: torch.Tensor) -> torch.Tensor:
    """Token embedding lookup: ids (B, T) -> (B, T, H)."""
    return nn.functional.embedding(ids, p["embed_tokens.weight"])


def head_weight(spec: ModelSpec, head: dict, emb: dict) -> torch.Tensor:
    """The LM head matrix (V, H): its own, or the embedding's when tied."""
    return emb["embed_tokens.weight"] if spec.tie_word_embeddings else head["lm_head.weight"]


def positions_for(ids: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """Positions (B, T): 0..T-1, restarting at each document boundary when packed."""
    B, T = ids.shape
    pos = torch.arange(T, device=ids.device).expand(B, T)
    if doc_ids is None:
        return pos
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # index of the latest document start at or before each token
    first = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return pos - first


class DenseModel(nn.Module):
    """All items as ``nn.Parameter`` flat buffers: embed, layers[i], head."""

    def __init__(self, spec: ModelSpec, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.spec = spec
        mk = lambda n: nn.Parameter(torch.zeros(n, dtype=dtype, device=device))  # noqa: E731
        self.embed = mk(spec.embed_layout.numel)
        self.layers = nn.ParameterList([mk(spec.params_per_layer) for _ in range(spec.num_layers)])
        self.head = mk(spec.head_layout.numel)

    def items(self):
        """(name, flat parameter, layout) in model order."""
        s = self.spec
        yield "embed", self.embed, s.embed_layout
        for i, p in enumerate(self.layers):
            yield f"layer{i}", p, s.layer_layout
        yield "head", self.head, s.head_layout

    def hidden(self, ids, doc_ids=None):
        """Final normed hidden states (B, T, H) and the LM head matrix."""
        s = self.spec
        emb = s.embed_layout.views(self.embed)
        x = embed(s, emb, ids)
        rope = rope_tables(s, positions_for(ids, doc_ids), x.dtype)
        mask = None if doc_ids is None else packed_causal_mask(doc_ids)
        for p in self.layers:
            x = decoder_layer(s, s.layer_layout.views(p), x, rope, mask)
        head = s.head_layout.views(self.head)
        return rms_norm(x, head["norm.weight"], s.rms_norm_eps), head_weight(s, head, emb)

    def logits(self, ids, doc_ids=None):
        h, w = self.hidden(ids, doc_ids)
        return h @ w.t()

    def loss(self, ids, labels, scale: float, doc_ids=None, chunk: int = 4096):
        """``scale`` * summed cross-entropy over labels != -100 (chunked, no full logits)."""
        h, w = self.hidden(ids, doc_ids)
        return linear_cross_entropy(h, w, labels, scale, chunk)
