"""The sliding-window executor: one training step over a model larger than the device.

Items are the embedding, the decoder layers and the head (final norm + LM head). The embedding
and head live on the device for the whole run; decoder layers stream through a pool of K
parameter slots (DESIGN §3.3):

    forward   layer 0 -> L-1: each layer's input saved per micro-batch, output without autograd;
              layer i+K-1 is prefetched while layer i computes; the last K stay resident
    head      final norm + chunked linear cross-entropy; gradient w.r.t. the last hidden state
    backward  layer L-1 -> 0: recompute from the checkpoint with autograd, accumulate the
              parameter gradients of all micro-batches in an fp32 gradient slot, one
              device->host copy per layer, squared norm accumulated on the device
    update    CPU AdamW per item in a worker thread (DESIGN §3.4): without clipping a layer's
              update starts as soon as its gradients reach the host (overlapping the backward),
              and layers without their own host gradient buffer borrow one of a ring of
              ``grad_ring`` (slideformer.engine.runtime.grad_ring); with exact clipping the last
              ``spec_layers`` host layers update speculatively in the backward and are repaired
              at the barrier if the coefficient is not 1 (slideformer.engine.runtime.grad_ring, which proves
              it exact); the other updates wait for the global norm, then run in order
              embed, 0 .. L-1, head, overlapping the next step's forward, which waits per item.
    device    with spare VRAM, the embedding and head (``device_update``) and the first
              ``device_layers`` decoder layers keep their master weights and moments on the
              device: no PCIe traffic, no CPU work, updated there right after the clip barrier
              (so the next forward starts on them while the CPU updates the rest)
    disk      layers in the NVMe tier (slideformer.engine.runtime.nvme) have their moments read ahead in
              update order as soon as the step's updates are known (after the clip barrier; at
              the step's start without clipping) and written behind after their update;
              the update waits for its read, the next forward only for the update.
    frozen    with ``lora`` (train.method lora / qlora) the base items are frozen: they stream
              through the same slots but get no gradient, and only the adapters ``lora{i}``
              (slideformer.engine.runtime.lora) train, updated on the device after the backward; the
              backward of a layer computes its input and adapter gradients only, and the base
              layers still resident when a step ends serve the next forward without a copy.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from slideformer.engine.dist.group import Single
from slideformer.engine.kernels import IGNORE
from slideformer.engine.kernels.linear_ce import linear_ce_fwd_bwd, linear_ce_loss
from slideformer.engine.kernels.attention import document_mask
from slideformer.engine.models.layers import decoder_layer, rms_norm, rope_tables
from slideformer.engine.models.lora import LoraForward, LoraSpec, dropout_seed
from slideformer.engine.models.model import embed, head_weight, positions_for
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.runtime.activations import DeviceStore, HostStore
from slideformer.engine.runtime.grad_ring import GradRing, Speculation
from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, DeviceItem, HostItem, adam_update
from slideformer.engine.runtime.lora import adapter_name
from slideformer.engine.runtime.norms import NormMasters
from slideformer.engine.runtime.shapes import DEVICE_CHUNK, ExecShape, speculative_layers
from slideformer.engine.runtime.slots import SlotPool
from slideformer.engine.runtime.timeline import StepTimeline


@dataclass(frozen=True)
class StepOutput:
    loss: float
    grad_norm: float
    tokens: int
    """Trained (labelled) tokens of the step."""
    skipped: bool
    timeline: StepTimeline
    applied: int = 0
    """Layer updates of a skipped step applied before its non-finite gradients were seen
    (without clipping only, where updates overlap the backward; 0: the skip was whole)."""


class _Guard:
    """Without clipping, whether a step's layer updates may still run.

    Each layer's update first reads the step's loss and that layer's squared gradient norm
    (copied to the host behind its gradients); the first non-finite one stops it and every
    later update of the step, so a non-finite loss skips the whole step and a gradient
    overflow keeps every layer from the faulty one down unchanged.
    """

    def __init__(self, values: torch.Tensor):
        self.values = values
        """Host copy: squared gradient norm per layer, then the loss."""
        self.bad = False
        self.applied = 0

    def allows(self, layer: int) -> bool:
        self.bad = self.bad or not (math.isfinite(float(self.values[layer]))
                                    and math.isfinite(float(self.values[-1])))
        return not self.bad


class _Sync:
    """Runs submitted work at once (CPU backend): deterministic, same interface as a pool."""

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        f.set_result(fn(*args))
        return f

    def shutdown(self) -> None:
        pass


class SlidingExecutor:
    """Owns the device buffers and runs training steps over the host state."""

    def __init__(self, spec: ModelSpec, backend, host: dict[str, HostItem], shape: ExecShape,
                 compute_dtype: torch.dtype, lora: LoraSpec | None = None, seed: int = 0,
                 group=None, residual_dtype: torch.dtype | None = None):
        """``lora``: train the adapters ``lora{i}`` of ``host`` over a frozen base (``seed``
        seeds their dropout masks). ``group``: the ranks of a data-parallel run sharing
        ``host`` (slideformer.engine.dist.group); None: this process alone. ``residual_dtype``:
        the hidden states between layers, their gradients, activation checkpoints and RoPE tables
        (fp32 under bf16 compute: autocast's numerics, slideformer.engine.models.layers); None:
        the compute dtype."""
        self.spec, self.backend, self.host, self.shape = spec, backend, host, shape
        self.group = group or Single()
        self.dtype = compute_dtype
        self.act = residual_dtype or compute_dtype
        self.lora, self.seed, self.step_no = lora, seed, 0
        L, n = spec.num_layers, spec.params_per_layer
        self.k = max(1, min(shape.slots, L))
        self.quant = getattr(host["layer0"], "quant", None)
        """NF4 byte layout of the decoder layers (qlora): a slot holds a layer's NF4 bytes,
        dequantised on the device into ``scratch`` when used; None: slots hold the weights."""
        if self.quant is None:
            self.slot_numel = n
            self.pool = SlotPool(backend, self.k, n, compute_dtype, L)
        else:
            self.slot_numel = self.quant.nbytes
            self.pool = SlotPool(backend, self.k, self.quant.nbytes, torch.uint8, L)
            self.scratch = backend.alloc(n, compute_dtype)
        self.embed_w = backend.alloc(spec.embed_layout.numel, compute_dtype)
        self.head_w = backend.alloc(spec.head_layout.numel, compute_dtype)
        trained = lora is None  # a frozen base needs no gradient buffers of its own
        self.embed_g = backend.alloc(spec.embed_layout.numel, torch.float32) if trained else None
        self.head_g = backend.alloc(spec.head_layout.numel, torch.float32) if trained else None
        self.gslots = [backend.alloc(n, torch.float32) for _ in range(shape.grad_slots * trained)]
        self.gslot_free: list[list] = [[] for _ in self.gslots]
        store = HostStore if shape.checkpoints == "host" else DeviceStore
        self.store = store(backend, L, shape.n_micro,
                           (shape.micro_batch, shape.seq_len, spec.hidden_size), self.act)
        self.norm_sq = backend.alloc((), torch.float32)
        self.health = backend.alloc(L + 1, torch.float32)
        self.health_host = backend.host_alloc(L + 1, torch.float32)
        self.step_updates = 0
        """Updates submitted by the current step so far (0 until its updates may start)."""
        self.updater = ThreadPoolExecutor(1, "cpu-adam") if backend.is_cuda else _Sync()
        self.workspace = AdamWorkspace()
        self.pending: dict[str, Future] = {}
        self.resident_stale = {"embed": True, "head": True}
        self.grads_out: dict[str, object] = {}
        self.G = min(shape.device_layers, L)
        disk = [i for i in range(L) if host[f"layer{i}"].disk is not None]
        self.snapshots = Speculation(host, speculative_layers(L, self.G, shape.spec_layers * trained,
                                                              disk),
                                backend.host_alloc, lambda k, dt: torch.zeros(k, dtype=dt))
        # zeros, not empty: the pages are resident from the start, as the planner counts them,
        # even while steps clip early and skip speculating (tests/engine/plan/test_plan_rss.py)
        self.speculated: list[int] = []
        """Layers of the current step whose speculative update was submitted."""
        borrow = [i for i in range(L)
                  if trained and host[f"layer{i}"].g is None and i not in self.snapshots]
        self.ring = GradRing(backend.host_alloc, min(shape.grad_ring, L) if borrow else 0, n)
        self.dev: dict[str, DeviceItem] = {}
        """Items updated on the device; their host items are refreshed by drain()."""
        if shape.device_update:
            self.dev["embed"] = DeviceItem(host["embed"], backend.alloc, self.embed_w, self.embed_g)
            self.dev["head"] = DeviceItem(host["head"], backend.alloc, self.head_w, self.head_g)
        for i in range(self.G):
            self.dev[f"layer{i}"] = DeviceItem(host[f"layer{i}"], backend.alloc)
        if lora is not None:
            if self.G or shape.device_update:
                raise ValueError("a frozen base has no device-updated base items")
            for i in range(L):
                self.dev[adapter_name(i)] = DeviceItem(host[adapter_name(i)], backend.alloc)
        wide = self.act != compute_dtype and self.quant is None and lora is None
        self.norms = NormMasters(backend, spec, host, self.dev) if wide else None
        """With a wider residual stream, the norm weights in fp32 (engine.runtime.norms)."""
        self.dev_ws = None if not self.dev else AdamWorkspace(
            DEVICE_CHUNK, backend.device, next(iter(self.dev.values())).m.dtype != torch.float32)
        self.dev_loaded = False

    # ---- host <-> device state -------------------------------------------------------------
    def _ensure_device_state(self) -> None:
        """Copy the device-updated items' state from the host before their first use."""
        if self.dev and not self.dev_loaded:
            for item in self.dev.values():
                item.push()
            for name in ("embed", "head"):
                if name in self.dev:
                    self.resident_stale[name] = False
            self.dev_loaded = True

    def host_changed(self) -> None:
        """The host state was replaced (a checkpoint was read): reload the device-updated items."""
        self.dev_loaded = False

    def _weights(self, layer: int) -> torch.Tensor:
        if layer < self.G:
            return self.dev[f"layer{layer}"].w
        w = self.pool.acquire(layer, self.slot_numel)
        # one scratch serves every layer: each use is queued on the compute stream after the last
        return w if self.quant is None else self.quant.dequantize(w, self.scratch)

    def _wait_update(self, name: str) -> None:
        fut = self.pending.pop(name, None)
        if fut is not None:
            fut.result()

    def _refresh(self, name: str, dev: torch.Tensor, tl: StepTimeline) -> None:
        """Bring an always-resident item up to date after its update."""
        self._wait_update(name)
        if self.resident_stale[name]:
            h = self.backend.start_h2d(dev, self.host[name].w)
            tl.device_span("h2d", name, h.start, h)
            self.backend.compute_waits(h)
            self.resident_stale[name] = False
            if self.norms is not None and name == "head":
                self.norms.load(name)

    def _prefetch(self, layer: int, tl: StepTimeline) -> None:
        """Load a layer ahead of need only if its update already finished: the forward must not
        wait for the CPU optimizer on a layer it does not need yet (with K = L slots it would
        otherwise wait for every update before computing layer 0)."""
        fut = self.pending.get(f"layer{layer}")
        if fut is None or fut.done():
            self._load(layer, tl)

    def _load(self, layer: int, tl: StepTimeline) -> None:
        if layer < self.G or self.pool.has(layer):
            return
        self._wait_update(f"layer{layer}")
        h = self.pool.start_load(layer, self.host[f"layer{layer}"].w)
        tl.device_span("h2d", f"layer{layer}", h.start, h)
        if self.norms is not None:
            self.norms.load(f"layer{layer}")

    def _norm_views(self, name: str, p: dict) -> dict:
        """An item's parameter views, with fp32 norm weights when the residual stream is wider."""
        return p if self.norms is None else self.norms.views(name, p)

    # ---- one step --------------------------------------------------------------------------
    def train_step(self, micro_batches, hyper: Callable[[float], AdamHyper],
                   max_grad_norm: float, timeline: bool = True) -> StepOutput:
        """Forward, backward and (scheduled) updates of one optimizer step.

        Args:
            micro_batches: list of objects with input_ids, labels, doc_ids (see slideformer.engine.data).
            hyper: AdamW hyper-parameters of this step given the clipping coefficient.
            max_grad_norm: exact global-norm clipping threshold; 0 disables clipping.
        """
        if max_grad_norm > 0 and self.ring.bufs:
            raise ValueError("exact clipping needs every layer's gradient until the global norm is "
                             "known: build the host state with layer_grads=True (the speculative "
                             "layers excepted)")
        self._ensure_device_state()
        tl = StepTimeline(self.backend, timeline)
        self.step_no = hyper(1.0).step
        if max_grad_norm <= 0:  # the layer updates start in the backward, last layer first
            self._prefetch_disk([f"layer{i}" for i in reversed(range(self.spec.num_layers))], tl)
        self.step_updates = 0
        self.speculated = []
        self.limit_sq = max_grad_norm ** 2
        tokens = sum(int((mb.labels != IGNORE).sum()) for mb in micro_batches)
        scale = 1.0 / max(tokens, 1)  # of the whole step: the ranks' gradients are summed
        inp = [self._inputs(mb) for mb in self.group.mine(micro_batches)]
        self._refresh("embed", self.embed_w, tl)
        xs = self.forward_window(inp, tl)
        self._refresh("head", self.head_w, tl)
        loss, gys = self.head_step(xs, inp, scale, tl)
        self.group.reduce(loss)
        del xs  # the last hidden states are not needed in the backward
        clip = max_grad_norm > 0
        guard = None
        if not clip and self.lora is None:  # frozen: every update waits for the backward
            guard = _Guard(self.health_host)
            self.health[-1:].copy_(loss.reshape(1))
            self.backend.start_d2h(self.health_host[-1:], self.health[-1:],
                                   after=[self.backend.mark()])
        self.backward_window(gys, inp, tl, None if clip else hyper(1.0), guard,
                             hyper(1.0) if clip and self.snapshots.snaps else None)
        norm = math.sqrt(float(self.norm_sq))  # the clip barrier: backward finished
        coef = min(1.0, max_grad_norm / (norm + 1e-6)) if clip else 1.0
        skipped = not (math.isfinite(norm) and math.isfinite(loss.item()))
        if skipped:  # keep the old weights; drop this step's gradients
            self.roll_back()
        else:
            names = ["embed"] + ([f"layer{i}" for i in range(self.spec.num_layers)] if clip else []) + ["head"]
            names = [name for name in names if name not in self.dev and self.lora is None]
            self._prefetch_disk(names, tl)
            for name in names:
                self._barrier_update(name, hyper(coef), coef, tl)
            self.speculated = []  # settled: they are this step's updates now
            self._device_updates(hyper(coef), tl)
        if self.lora is None:  # a frozen base stays valid: its resident layers serve the next step
            self.pool.invalidate_all()
        self.group.step_done(self.wait_updates)
        applied = guard.applied if skipped and guard is not None else 0
        return StepOutput(float(loss), norm, tokens, skipped, tl, applied)

    def _barrier_update(self, name: str, hp: AdamHyper, coef: float, tl: StepTimeline) -> None:
        """The update of ``name`` once the norm is known; a speculative layer's update stands
        when the coefficient is 1 and is redone from its snapshot otherwise."""
        layer = int(name[5:]) if name.startswith("layer") else -1
        if layer not in self.speculated:
            self._submit_update(name, hp, tl)
        else:
            self.pending[name] = self.updater.submit(self._settle, layer, self.pending[name], hp,
                                                     coef, tl)

    def _may_speculate(self, layer: int) -> bool:
        """False once the squared gradient norms of layers L-1 .. ``layer`` (on the host behind
        their gradients) already exceed the limit: the coefficient will be below 1, so an
        update with 1 would be wasted work (a heuristic only: the barrier settles it exactly)."""
        partial = float(self.health_host[layer:self.spec.num_layers].sum())
        return not (partial > self.limit_sq)

    def _settle(self, layer: int, speculative: Future, hp: AdamHyper, coef: float,
                tl: StepTimeline) -> None:
        """At the barrier: keep a speculative update made with the right coefficient, else
        redo it from the snapshot; a layer that did not speculate updates now."""
        speculative.result()  # submitted before this to the same worker: already done
        item = self.host[f"layer{layer}"]
        saved = self.snapshots.take(layer)
        if saved and coef == 1.0:
            return
        t0 = time.perf_counter()
        if saved:
            self.snapshots.restore(layer, item)
        adam_update(item, hp, self.workspace, grad=self.snapshots.grad(layer, item.numel))
        tl.host_span("optimizer", f"layer{layer}", t0, time.perf_counter())

    def roll_back(self) -> None:
        """Drop the current step: wait for its updates, undo its speculative ones (a skipped
        step, or one that failed in its backward)."""
        for fut in list(self.pending.values()):
            fut.result()
        self.pending.clear()
        for layer in self.speculated:
            if self.snapshots.take(layer):
                self.snapshots.restore(layer, self.host[f"layer{layer}"])
        self.speculated = []

    def _inputs(self, mb):
        dev = self.backend.device
        ids = mb.input_ids.to(dev, non_blocking=True)
        doc = None if mb.doc_ids is None else mb.doc_ids.to(dev, non_blocking=True)
        rope = rope_tables(self.spec, positions_for(ids, doc), self.act)
        # one mask per micro-batch, reused by every layer's forward and recompute
        mask = None if doc is None else document_mask(doc, self.spec.head_dim)
        return ids, mb.labels.to(dev, non_blocking=True), rope, mask

    def forward_window(self, inp, tl: StepTimeline, save: bool = True) -> list[torch.Tensor]:
        """Layer-wise forward of every micro-batch; returns the last hidden states.

        ``save`` keeps each layer's inputs as activation checkpoints (training).
        """
        spec, L, k = self.spec, self.spec.num_layers, self.k
        emb = spec.embed_layout.views(self.embed_w)
        with torch.no_grad():
            xs = [embed(spec, emb, ids).to(self.act) for ids, *_ in inp]
            for i in range(L):
                self._load(i, tl)
                ahead = max(i + 1, self.G)  # the device layers need no slot
                for j in range(ahead, min(ahead + k - 1, L)):
                    self._prefetch(j, tl)
                p = self._norm_views(f"layer{i}", spec.layer_layout.views(self._weights(i)))
                t0 = self.backend.mark()
                for mb, (_, _, rope, mask) in enumerate(inp):
                    if save:
                        self.store.save(i, mb, xs[mb])
                    xs[mb] = decoder_layer(spec, p, xs[mb], rope, mask,
                                           lora=self._adapters(i, mb, save))
                tl.device_span("compute", f"layer{i}", t0, self.backend.mark())
                if i >= self.G:
                    self.pool.release(i, evict=i < L - k)
        return xs

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
        for x, (_, labels, _, _) in zip(xs, inp):
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                h = rms_norm(x, nw, spec.rms_norm_eps, self.dtype)
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
        for name in ("embed", "head"):
            for h in self.grads_out.pop(name, []):
                self.backend.compute_waits(h)
        for g in (self.embed_g, self.head_g):
            if g is not None:
                g.zero_()
        self.norm_sq.zero_()

    def backward_window(self, gys, inp, tl: StepTimeline, hyper_now: AdamHyper | None,
                        guard: _Guard | None = None, hyper_spec: AdamHyper | None = None) -> None:
        """Layer-wise backward with recompute; gradients leave for the host one layer at a time.

        With ``hyper_now`` (no clipping) each layer's update is submitted at once, behind
        ``guard``'s check of its gradient norm; with ``hyper_spec`` (clipping) the speculative
        layers' updates are.
        """
        spec, L, k = self.spec, self.spec.num_layers, self.k
        n = spec.params_per_layer
        for i in reversed(range(L)):
            self.store.prefetch(i - 1)
            for j in range(i, max(i - k, -1), -1):
                self._load(j, tl)
            w = self._weights(i)
            if self.lora is not None:  # the adapters' gradient buffer, on the device
                g = self.dev[adapter_name(i)].g
            elif i < self.G:  # its own gradient buffer, read by the device update on this stream
                g = self.dev[f"layer{i}"].g
            else:
                slot = i % len(self.gslots)
                for h in self.gslot_free[slot]:
                    self.backend.compute_waits(h)
                g = self.gslots[slot][:n]
            g.zero_()
            t0 = self.backend.mark()
            for mb, (_, _, rope, mask) in enumerate(inp):
                gys[mb] = self._layer_backward(w, g, self.store.load(i, mb), gys[mb], rope, mask,
                                               i, mb)
            self.group.reduce(g)
            sq = torch.linalg.vector_norm(g).square()
            self.norm_sq += sq
            watched = guard is not None or hyper_spec is not None  # norms on the host, per layer
            if watched:
                self.health[i].copy_(sq)
            t1 = self.backend.mark()
            tl.device_span("compute", f"layer{i}", t0, t1)
            if self.lora is not None:  # frozen: nothing leaves; the low layers stay for the next step
                self.pool.release(i, evict=i >= k)
            elif i >= self.G:
                self.gslot_free[slot] = self._send_grad(i, g, t1, tl, hyper_now, guard, hyper_spec,
                                                        watched)
                self.pool.release(i, evict=True)
            self.store.done_with(i)
        self._embed_backward(gys, inp, tl)

    def _send_grad(self, i: int, g: torch.Tensor, t1, tl: StepTimeline, hyper_now, guard,
                   hyper_spec, watched: bool) -> list:
        """Copy layer i's gradient (and, if ``watched``, its squared norm) to the host and submit
        the update it may start now; returns the copy's handle (the gradient slot is free once
        it is done)."""
        name, n = f"layer{i}", self.spec.params_per_layer
        dest, r = self.host[name].g, None
        if i in self.snapshots:
            dest = self.snapshots.grad(i, n)
        elif dest is None:  # a ring buffer, once the update that last read it is done
            r, dest = self.ring.take(n)
        part = self.group.span(n)  # the slice whose update this rank owns
        h = self.backend.start_d2h(dest[part], g[part], after=[t1])
        tl.device_span("d2h", name, h.start, h)
        self.grads_out[name] = [h]
        if watched:
            self.grads_out[name].append(self.backend.start_d2h(
                self.health_host[i:i + 1], self.health[i:i + 1], after=[t1]))
        if hyper_now is not None:
            self._submit_update(name, hyper_now, tl, guard, i, dest)
            if r is not None:
                self.ring.used_by(r, self.pending[name])
        elif hyper_spec is not None and i in self.snapshots:
            self._submit_update(name, hyper_spec, tl, layer=i, grad=dest, speculative=True)
            self.speculated.append(i)
        return [h]

    def _layer_backward(self, w, g, x, gy, rope, mask, layer: int = 0, mb: int = 0) -> torch.Tensor:
        """Recompute one layer for one micro-batch, add its trained parameters' grads (the
        layer's, or with a frozen base its adapters') to g; return dL/dx."""
        spec = self.spec
        base = self._norm_views(f"layer{layer}", spec.layer_layout.views(w))
        if self.lora is None:
            layout, leaves = spec.layer_layout, {k: v.detach().requires_grad_() for k, v in base.items()}
            base, adapters = leaves, None
        else:
            item = self.dev[adapter_name(layer)]
            layout = item.layout
            leaves = {k: v.detach().requires_grad_() for k, v in layout.views(item.w).items()}
            adapters = LoraForward(self.lora, leaves, self._dropout_seed(layer, mb, True))
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = decoder_layer(spec, base, x, rope, mask, lora=adapters)
            grads = torch.autograd.grad(y, [x, *leaves.values()], gy)
        for (_, off, _), gp in zip(layout.entries, grads[1:]):
            g[off:off + gp.numel()].add_(gp.reshape(-1))
        return grads[0]

    def _dropout_seed(self, layer: int, mb: int, train: bool) -> int | None:
        if not train or not self.lora.dropout:
            return None
        return dropout_seed(self.seed, self.step_no, layer, mb)

    def _adapters(self, layer: int, mb: int, train: bool) -> LoraForward | None:
        """The forward's view of a layer's adapters (None when the base is trained)."""
        if self.lora is None:
            return None
        item = self.dev[adapter_name(layer)]
        return LoraForward(self.lora, item.layout.views(item.w), self._dropout_seed(layer, mb, train))

    def _embed_backward(self, gys, inp, tl: StepTimeline) -> None:
        if self.lora is not None:  # a frozen embedding needs no gradient
            return
        t0 = self.backend.mark()
        H = self.spec.hidden_size
        ge = self.embed_g.view(-1, H)
        for gy, (ids, *_) in zip(gys, inp):
            ge.index_add_(0, ids.reshape(-1), gy.reshape(-1, H).float())
        self.group.reduce(self.embed_g)
        self.group.reduce(self.head_g)
        self.norm_sq += torch.linalg.vector_norm(self.embed_g).square()
        self.norm_sq += torch.linalg.vector_norm(self.head_g).square()
        t1 = self.backend.mark()
        tl.device_span("compute", "embed", t0, t1)
        for name, buf in (("embed", self.embed_g), ("head", self.head_g)):
            if name in self.dev:
                continue
            part = self.group.span(buf.numel())
            h = self.backend.start_d2h(self.host[name].g[part], buf[part], after=[t1])
            tl.device_span("d2h", name, h.start, h)
            self.grads_out[name] = [h]

    def _prefetch_disk(self, names, tl: StepTimeline) -> None:
        """Start reading the moments of the disk items among ``names`` (in update order)."""
        for name in names:
            if self.host[name].disk is not None:
                self.host[name].disk.prefetch(tl)

    def _submit_update(self, name: str, hp: AdamHyper, tl: StepTimeline,
                       guard: _Guard | None = None, layer: int = 0,
                       grad: torch.Tensor | None = None, speculative: bool = False) -> None:
        """``speculative``: snapshot the layer first; the update is undone if the step is
        (so it does not count among the step's applied updates)."""
        handles = self.grads_out.get(name, [])
        if name in ("embed", "head"):
            self.resident_stale[name] = True
        self.step_updates += not speculative
        self.pending[name] = self.updater.submit(self._update, name, handles, hp, tl, guard, layer,
                                                 grad, speculative)

    def _update(self, name: str, handles, hp: AdamHyper, tl: StepTimeline,
                guard: _Guard | None, layer: int, grad: torch.Tensor | None = None,
                speculative: bool = False) -> None:
        for h in handles:
            h.wait()
        if guard is not None and not guard.allows(layer):
            return
        item = self.group.owned(self.host[name])
        grad = None if grad is None else grad[self.group.span(grad.numel())]
        staged = None if item.disk is None else item.disk.acquire(tl)
        try:
            t0 = time.perf_counter()
            if speculative and not self._may_speculate(layer):
                return
            if speculative:
                self.snapshots.save(layer, item)
            adam_update(item, hp, self.workspace, staged=staged, grad=grad)
            tl.host_span("optimizer", name, t0, time.perf_counter())
        finally:
            if item.disk is not None:
                item.disk.release(True, tl)
        if guard is not None:
            guard.applied += 1

    def _device_updates(self, hp: AdamHyper, tl: StepTimeline) -> None:
        """AdamW of the device-updated items, queued on the compute stream after the backward."""
        if not self.dev:
            return
        t0 = self.backend.mark()
        for item in self.dev.values():
            adam_update(item, hp, self.dev_ws, native=False)
        tl.device_span("compute", "device optimizer", t0, self.backend.mark())

    def eval_loss(self, mb) -> tuple[float, int]:
        """(summed loss, labelled tokens) of one micro-batch, forward only."""
        self._ensure_device_state()
        tl = StepTimeline(self.backend, enabled=False)
        inp = [self._inputs(mb)]
        self._refresh("embed", self.embed_w, tl)
        xs = self.forward_window(inp, tl, save=False)
        self._refresh("head", self.head_w, tl)
        head = self._norm_views("head", self.spec.head_layout.views(self.head_w))
        w = (self.spec.embed_layout.views(self.embed_w)["embed_tokens.weight"]
             if self.spec.tie_word_embeddings else head["lm_head.weight"])
        with torch.no_grad():
            h = rms_norm(xs[0], head["norm.weight"], self.spec.rms_norm_eps, self.dtype)
            loss = linear_ce_loss(h, w, inp[0][1], self.shape.head_chunk)
        for i in range(self.spec.num_layers):  # drop the resident layers' slots cleanly
            if self.pool.has(i):
                self.pool.release(i, evict=True)
        return float(loss), int((mb.labels != IGNORE).sum())

    def wait_updates(self) -> None:
        """Wait for every update in flight."""
        for name in list(self.pending):
            self._wait_update(name)

    def drain(self) -> None:
        """Wait for every update in flight and its disk writes (before saving or reading the state)."""
        self.wait_updates()
        for item in self.host.values():
            if item.disk is not None:
                item.disk.flush()
        if self.dev_loaded:
            for item in self.dev.values():
                item.pull()

    def close(self) -> None:
        self.drain()
        self.updater.shutdown()
