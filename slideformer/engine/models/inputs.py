"""What each decoder layer of one micro-batch reads besides its weights: positions, RoPE tables
and the attention mask, per layer type.

Layers of one type share them: the full-attention layers one mask (plain causal: None, the
flash path; packed documents: the document mask), the sliding layers one windowed mask
(the same as the full layers' while the rows are no longer than the window), and the RoPE
tables of the global or, for the sliding layers of a family with its own local RoPE (Gemma 3),
the local frequencies, as wide as the layer's heads (Gemma 4's full layers have heads of their
own); NoPE layers get no tables. A gated DeltaNet layer (Qwen3.5) has neither:
in the mask's place it gets the rows' document ids (None: one document per row), where its
recurrence restarts.
"""
from __future__ import annotations

from typing import Callable

import torch

from slideformer.engine.models.families.base import LINEAR, SLIDING
from slideformer.engine.models.spec import ModelSpec


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


class LayerInputs:
    """Per layer of one micro-batch: (rope, mask) for :func:`models.layers.decoder_layer`."""

    def __init__(self, spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype,
                 full_mask, sliding_mask, doc_ids: torch.Tensor | None = None):
        """``positions`` (B, T); the masks of the full and of the sliding layers; the rows'
        document ids (packed rows) for the gated DeltaNet layers."""
        from slideformer.engine.models.layers import rope_tables  # layers imports this module
        L = spec.num_layers
        rope = [(spec.local_rope is not None and spec.layer_type(i) == SLIDING,
                 spec.head_dim_of(i)) for i in range(L)]  # (local RoPE, head size) per layer
        tables = {key: rope_tables(spec, positions, dtype, *key) for key in set(rope)}
        masks = {False: full_mask, True: sliding_mask}
        self.layers = [(None, doc_ids) if spec.layer_type(i) == LINEAR else
                       (tables[rope[i]] if spec.has_rope(i) else None,
                        masks[spec.layer_type(i) == SLIDING]) for i in range(L)]

    @staticmethod
    def of_rows(spec: ModelSpec, ids: torch.Tensor, doc_ids: torch.Tensor | None,
                dtype: torch.dtype, make_mask: Callable) -> "LayerInputs":
        """Training rows ids (B, T), packed when ``doc_ids`` are given. ``make_mask(doc_ids,
        window or None)``: the mask of rows with those document ids
        (``kernels.attention.document_mask`` or ``packed_causal_mask``)."""
        full = None if doc_ids is None else make_mask(doc_ids, None)
        sliding, w = full, spec.sliding_window
        if w is not None and ids.shape[1] > w:
            sliding = make_mask(doc_ids if doc_ids is not None else torch.zeros_like(ids), w)
        return LayerInputs(spec, positions_for(ids, doc_ids), dtype, full, sliding, doc_ids)

    def at(self, i: int):
        """(rope, mask) of layer ``i``."""
        return self.layers[i]
