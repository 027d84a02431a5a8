"""The resident ends of the sliding executor: the embedding's and the head's step on the device.

The embedding and the head (final norm + LM head, or the tied embedding) stay on the device for
the whole run (runtime.executor): the head turns the last hidden states into the loss and dL/dx
of every micro-batch, the embedding's backward scatters the first layer's dL/dx into its
gradient, and both gradients leave for the host after it (or stay, updated on the device).
"""
from __future__ import annotations

import torch

from slideformer.engine.kernels import IGNORE
from slideformer.engine.kernels.linear_ce import linear_ce_fwd_bwd, linear_ce_loss
from slideformer.engine.models.model import embed_scale, final_norm, head_weight
from slideformer.engine.runtime.timeline import StepTimeline


class ResidentEnds:
    """Methods of runtime.executor.SlidingExecutor for the embedding and the head (its
    attributes: spec, backend, shape, dtype, lora, group, embed/head items, their weights and
    grads, norm_sq)."""

    def head_step(self, xs, inp, scale: float, tl: StepTimeline):
        """Loss of every micro-batch and the gradients w.r.t. the last hidden states."""
        spec = self.spec
        t0 = self.backend.mark()
        head = self._norm_views("head", spec.head_layout.views(self.head_w))
        w = head_weight(spec, head, spec.embed_layout.views(self.embed_w))
        trained = self.lora is None  # else the head is frozen: dL/dx only
        if trained:
            ghead = spec.head_layout.views(self.head_g)
            gw = head_weight(spec, ghead, spec.embed_layout.views(self.embed_g))
        self._zero_resident_grads()
        nw = head["norm.weight"].detach().requires_grad_(trained)
        loss = torch.zeros((), dtype=torch.float32, device=self.backend.device)
        gys = []
        for x, (_, labels, _) in zip(xs, inp):
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                h = final_norm(spec, nw, x, self.dtype)
            lmb, gh = linear_ce_fwd_bwd(h.detach(), w, labels, scale, self.shape.head_chunk,
                                        gw if trained else None)
            loss += lmb
            grads = torch.autograd.grad(h, [x, nw] if trained else [x], gh)
            if trained:
                ghead["norm.weight"].add_(grads[1])
            gys.append(grads[0])
        tl.device_span("compute", "head", t0, self.backend.mark())
        return loss, gys

    def _zero_resident_grads(self) -> None:
        for item in (self.embed, self.head):
            for h in item.grads_out:
                self.backend.compute_waits(h)
            item.grads_out = []
        for g in (self.embed_g, self.head_g):
            if g is not None:
                g.zero_()
        self.norm_sq.zero_()

    def _embed_backward(self, gys, inp, tl: StepTimeline) -> None:
        if self.lora is not None:  # a frozen embedding needs no gradient
            return
        t0 = self.backend.mark()
        H = self.spec.hidden_size
        ge = self.embed_g.view(-1, H)
        scale = embed_scale(self.spec, self.embed_w.dtype) or 1.0  # d(scale * E[id]) / dE[id]
        for gy, (ids, *_) in zip(gys, inp):
            ge.index_add_(0, ids.reshape(-1), gy.reshape(-1, H).float() * scale)
        self.group.reduce(self.embed_g)
        self.group.reduce(self.head_g)
        self.norm_sq += torch.linalg.vector_norm(self.embed_g).square()
        self.norm_sq += torch.linalg.vector_norm(self.head_g).square()
        t1 = self.backend.mark()
        tl.device_span("compute", "embed", t0, t1)
        for item in (self.embed, self.head):
            if item.on_device:
                continue
            part = self.group.span(item.grad.numel())
            h = self.backend.start_d2h(item.host.g[part], item.grad[part], after=[t1])
            tl.device_span("d2h", item.name, h.start, h)
            item.grads_out = [h]

    def eval_loss(self, mb) -> tuple[float, int]:
        """(summed loss, labelled tokens) of one micro-batch, forward only."""
        self._ensure_device_state()
        tl = StepTimeline(self.backend, enabled=False)
        inp = [self._inputs(mb)]
        self._refresh(self.embed, tl)
        xs = self.forward_window(inp, tl, save=False)
        self._refresh(self.head, tl)
        head = self._norm_views("head", self.spec.head_layout.views(self.head_w))
        w = (self.spec.embed_layout.views(self.embed_w)["embed_tokens.weight"]
             if self.spec.tie_word_embeddings else head["lm_head.weight"])
        with torch.no_grad():
            h = final_norm(self.spec, head["norm.weight"], xs[0], self.dtype)
            loss = linear_ce_loss(h, w, inp[0][1], self.shape.head_chunk)
        for i in range(self.spec.num_layers):  # drop the resident layers' slots cleanly
            if self.pool.has(i):
                self.pool.release(i, evict=True)
        return float(loss), int((mb.labels != IGNORE).sum())
