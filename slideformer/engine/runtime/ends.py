"""The resident ends of the sliding executor: the embedding's and the head's step on the device.

The embedding and the head (final norm + LM head, or the tied embedding) stay on the device for
the whole run (runtime.executor): the head turns the last hidden states into the loss and dL/dx
of every micro-batch, the embedding's backward scatters the first layer's dL/dx into its
gradient, and both gradients leave for the host after it (or stay, updated on the device).
"""
from __future__ import annotations

import torch

from slideformer.engine.kernels import IGNORE
from slideformer.engine.kernels.linear_ce import linear_ce_fwd_bwd, linear_ce_loss, linear_ce_rows
from slideformer.engine.models.model import embed_scale, final_norm, head_weight
from slideformer.engine.runtime.timeline import StepTimeline
from slideformer.engine.config import PreferenceConfig
from slideformer.engine.train.objectives import NEEDS_REFERENCE, sequence_weights


class ResidentEnds:
    """Methods of runtime.executor.SlidingExecutor for the embedding and the head (its
    attributes: spec, backend, shape, dtype, lora, group, embed/head items, their weights and
    grads, norm_sq)."""

    objective: tuple[str, PreferenceConfig] | None = None
    """A preference objective (train.objective, its [preference] settings) instead of the
    next-token loss: :meth:`preference_step` is then the head's step."""

    def _head_weights(self):
        """(head weight, its dL/dW buffer or None, final-norm weight, its gradient view or
        None): the head is frozen under LoRA (dL/dx only)."""
        spec = self.spec
        head = self._norm_views("head", spec.head_layout.views(self.head_w))
        w = head_weight(spec, head, spec.embed_layout.views(self.embed_w))
        gw = gnorm = None
        if self.lora is None:
            ghead = spec.head_layout.views(self.head_g)
            gw = head_weight(spec, ghead, spec.embed_layout.views(self.embed_g))
            gnorm = ghead["norm.weight"]
        self._zero_resident_grads()
        return w, gw, head["norm.weight"].detach().requires_grad_(gw is not None), gnorm

    def _head_backward(self, x, labels, w, gw, nw, gnorm, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, dL/dx) of one micro-batch; dL/dW and the norm's gradient added."""
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            h = final_norm(self.spec, nw, x, self.dtype)
        lmb, gh = linear_ce_fwd_bwd(h.detach(), w, labels, scale, self.shape.head_chunk, gw,
                                    softcap=self.spec.logit_softcap)
        grads = torch.autograd.grad(h, [x, nw] if gnorm is not None else [x], gh)
        if gnorm is not None:
            gnorm.add_(grads[1])
        return lmb, grads[0]

    def head_step(self, xs, inp, scale: float, tl: StepTimeline):
        """Loss of every micro-batch and the gradients w.r.t. the last hidden states."""
        t0 = self.backend.mark()
        w, gw, nw, gnorm = self._head_weights()
        loss = torch.zeros((), dtype=torch.float32, device=self.backend.device)
        gys = []
        for x, (_, labels, _) in zip(xs, inp):
            lmb, gy = self._head_backward(x, labels, w, gw, nw, gnorm, scale)
            loss += lmb
            gys.append(gy)
        tl.device_span("compute", "head", t0, self.backend.mark())
        return loss, gys

    def weighted_step(self, xs, inp, weights, tl: StepTimeline, kl=None):
        """(loss, dL/dx of every micro-batch) when each row's target tokens count with the
        row's weight (GRPO, train.grpo: ``weights`` one (rows,) tensor per micro-batch): the
        loss is the sum over rows of weight x the row's summed cross-entropy (its value from a
        forward pass over the head, the gradient from one weighted backward).

        ``kl``: (beta, [(norm (rows,), reference log-probs (rows, T)) per micro-batch]) adds
        GRPO's KL penalty to the reference, beta * sum_t norm_r * D_t with DeepSeekMath's
        estimator D_t = exp(r_t - l_t) - (r_t - l_t) - 1 (l_t the token's log-probability
        now, r_t the reference's). dD_t/dl_t = 1 - exp(r_t - l_t), so the penalty moves each
        token's cross-entropy weight by -beta * norm_r * (1 - exp(r_t - l_t)): the same one
        weighted backward gives the exact gradient."""
        t0 = self.backend.mark()
        w, gw, nw, gnorm = self._head_weights()
        loss = torch.zeros((), dtype=torch.float32, device=self.backend.device)
        gys = []
        for k, (x, (_, labels, _), row_w) in enumerate(zip(xs, inp, weights)):
            row_w = row_w.to(self.backend.device, torch.float32)
            with torch.no_grad():
                h = final_norm(self.spec, nw, x, self.dtype)
                ce = linear_ce_rows(h, w, labels, self.shape.head_chunk,
                                    softcap=self.spec.logit_softcap)  # (rows, T)
                loss += (ce.sum(1) * row_w).sum()
            scale = row_w[:, None].expand(labels.shape).contiguous()  # (rows, T)
            if kl is not None:
                beta, (norm, ref) = kl[0], kl[1][k]
                norm = norm.to(ce.device, torch.float32)[:, None]  # (rows, 1)
                on = labels != IGNORE
                d = torch.where(on, ref.to(ce.device, torch.float32) + ce, 0.0)  # r - l
                e = torch.exp(d)
                loss += beta * (norm * torch.where(on, e - d - 1, 0.0)).sum()
                scale = scale - beta * norm * torch.where(on, 1 - e, 0.0)
            gys.append(self._head_backward(x, labels, w, gw, nw, gnorm, scale)[1])
        tl.device_span("compute", "head", t0, self.backend.mark())
        return loss, gys

    def preference_step(self, xs, inp, references, tl: StepTimeline, desirable=None):
        """(loss, dL/dx of every micro-batch, PairStats) of a preference objective.

        Two passes over the head: the response log-probability of every row (each micro-batch
        holds P pairs as P chosen then P rejected rows), then, with the weights -dL/dS of each
        row (train.objectives), one weighted cross-entropy backward: the exact gradient."""
        kind, cfg = self.objective
        t0 = self.backend.mark()
        w, gw, nw, gnorm = self._head_weights()
        logps, counts = [], []
        for x, (_, labels, _) in zip(xs, inp):
            with torch.no_grad():
                h = final_norm(self.spec, nw, x, self.dtype)
            logps.append(-linear_ce_rows(h, w, labels, self.shape.head_chunk,
                                         softcap=self.spec.logit_softcap).sum(1))
            counts.append((labels != IGNORE).sum(1))
        halves = [len(lp) // 2 for lp in logps]

        def pair_order(rows):  # the step's chosen rows, then its rejected ones
            return torch.cat([r[:p] for r, p in zip(rows, halves)] +
                             [r[p:] for r, p in zip(rows, halves)])
        ref = None
        if NEEDS_REFERENCE[kind]:
            ref = pair_order([r.to(logps[0].device) for r in references])
        P = sum(halves)
        labels_ok = None if desirable is None else torch.cat(list(desirable)).to(ref.device)
        loss, weights, stats = sequence_weights(kind, cfg, pair_order(logps), pair_order(counts),
                                                ref, P, labels_ok)
        gys, at = [], 0
        for x, (_, labels, _), p in zip(xs, inp, halves):
            row_w = torch.cat([weights[at:at + p], weights[P + at:P + at + p]])  # (2p,)
            at += p
            scale = row_w[:, None].expand(labels.shape).contiguous()  # (2p, T)
            gys.append(self._head_backward(x, labels, w, gw, nw, gnorm, scale)[1])
        tl.device_span("compute", "head", t0, self.backend.mark())
        return torch.tensor(loss, dtype=torch.float32, device=self.backend.device), gys, stats

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
        h, w, labels = self._eval_hidden(mb)
        with torch.no_grad():
            loss = linear_ce_loss(h, w, labels, self.shape.head_chunk,
                                  softcap=self.spec.logit_softcap)
        return float(loss), int((mb.labels != IGNORE).sum())

    def row_logps(self, mb) -> torch.Tensor:
        """(B,) fp32 on the host: each row's summed log-probability of its labelled tokens
        (the reference pass of a preference objective), forward only."""
        return self.token_logps(mb).sum(1).cpu()

    def token_logps(self, mb, base: bool = False) -> torch.Tensor:
        """(B, T) fp32: each labelled token's log-probability (0 elsewhere), forward only;
        ``base``: a LoRA run's base with its adapters off (GRPO's KL reference)."""
        self.base_only = base
        try:
            h, w, labels = self._eval_hidden(mb)
        finally:
            self.base_only = False
        return -linear_ce_rows(h, w, labels, self.shape.head_chunk, softcap=self.spec.logit_softcap)

    base_only: bool = False
    """The forward runs without the LoRA adapters (:meth:`token_logps`)."""

    def _eval_hidden(self, mb):
        """(final hidden states, head weight, labels) of one micro-batch, forward only."""
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
        for i in range(self.spec.num_layers):  # drop the resident layers' slots cleanly
            if self.pool.has(i):
                self.pool.release(i, evict=True)
        return h, w, inp[0][1]
