"""The RMSNorm weights in fp32 on the device, for the autocast precision.

``torch.autocast`` keeps an fp32 model's norm weights in fp32 (only matmul inputs are cast to
bf16), while the parameter slots and the resident head hold bf16 weights. The exact fp32
master of a norm weight is its bf16 weight and its 16-bit remainder
(slideformer.engine.runtime.host_state.join_master), so each item keeps the remainders of its
norm weights in a small device buffer, refreshed whenever the item's weights go to the device
(its update has finished then), and the layer maths reads norm views joined from the two.
Items updated on the device join from their own remainders. An item without remainders in
RAM (remainders in the NVMe tier) keeps its bf16 norm weights.
"""
from __future__ import annotations

import torch

from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.runtime.host_state import join_master


class NormMasters:
    """fp32 views of the norm weights of every decoder layer and the head."""

    def __init__(self, backend, spec: ModelSpec, host: dict, dev: dict):
        """``host``: the host items; ``dev``: the items updated on the device (their remainders
        are there already)."""
        self.backend, self.host, self.dev = backend, host, dev
        self.entries = {"head": spec.head_layout.norms()}
        names = [f"layer{i}" for i in range(spec.num_layers)] + ["head"]
        self.entries.update({f"layer{i}": spec.layout(i).norms() for i in range(spec.num_layers)})
        self.staging: dict[str, torch.Tensor] = {}
        self.rem: dict[str, torch.Tensor] = {}
        """Per item, its norm weights' remainders on the device, one after the other."""
        self.loaded: dict[str, object] = {}
        """Handle of each item's latest remainder copy."""
        for name in names:
            if name not in dev and host[name].rem is not None:
                n = sum(k for _, _, k in self.entries[name])
                self.staging[name] = backend.host_alloc(n, torch.int16)
                self.rem[name] = backend.alloc(n, torch.int16)

    def load(self, name: str):
        """Send an item's current norm remainders to the device (call once its update is done);
        returns the copy's handle, or None when nothing is sent."""
        if name not in self.rem:
            return None
        rem, at = self.host[name].rem, 0
        for _, off, k in self.entries[name]:
            self.staging[name][at:at + k].copy_(rem[off:off + k])
            at += k
        self.loaded[name] = self.backend.start_h2d(self.rem[name], self.staging[name])
        return self.loaded[name]

    def views(self, name: str, p: dict) -> dict:
        """``p`` (an item's parameter views) with its norm weights as fp32 masters."""
        if name in self.dev:
            rem = self.dev[name].rem
            parts = [rem[off:off + k] for _, off, k in self.entries[name]]
        elif name in self.loaded:
            self.backend.compute_waits(self.loaded[name])
            parts = list(torch.split(self.rem[name], [k for _, _, k in self.entries[name]]))
        else:
            return p
        out = dict(p)
        for (key, _, k), r in zip(self.entries[name], parts):
            w = p[key]
            out[key] = join_master(w.reshape(-1), r, torch.empty(k, dtype=torch.float32,
                                                               device=w.device)).view(w.shape)
        return out
