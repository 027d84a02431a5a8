"""The sliding-window executor: one training step over a model larger than the device.

The schedule lives here: each item's state is a WindowItem (runtime.window), the host updates
run in runtime.updates, the embedding's and head's device steps in runtime.ends, the backward
through the window and the gradients' way to the host in runtime.backward, and the backend and
the disk tier are typed protocols (runtime.protocols).

Items are the embedding, the decoder layers and the head (final norm + LM head). The embedding
and head live on the device for the whole run; decoder layers stream through a pool of K
parameter slots (DESIGN §3.3):

    forward   layer 0 -> L-1: each layer's input saved per micro-batch, output without autograd;
              layer i+K-1 is prefetched while layer i computes; the last K stay resident
    head      final norm + chunked linear cross-entropy; gradient w.r.t. the last hidden state
    backward  layer L-1 -> 0: recompute from the checkpoint with autograd, accumulate the
              parameter gradients of all micro-batches in an fp32 gradient slot, one
              device->host copy per layer, squared norm accumulated on the device
    update    CPU AdamW per item in a worker thread (runtime.updates, DESIGN §3.4): without
              clipping a layer's update starts as soon as its gradients reach the host (layers
              without a host gradient buffer borrow one of a ring, runtime.grad_ring); with
              exact clipping the last ``spec_layers`` host layers update speculatively and are
              settled at the barrier, the others wait for the global norm and run in order
              embed, 0 .. L-1, head, overlapping the next step's forward, which waits per item.
    regen     with exact clipping the lowest ``regen_layers`` host layers keep no gradient: a
              second backward over them after the barrier regenerates it, and their updates
              start as it lands (runtime.regen)
    device    with spare VRAM, the embedding and head (``device_update``) and the first
              ``device_layers`` decoder layers keep their master weights and moments on the
              device: no PCIe traffic, no CPU work, updated there right after the clip barrier
              (so the next forward starts on them while the CPU updates the rest)
    disk      layers in the NVMe tier (runtime.nvme) have their moments read ahead in
              update order as soon as the step's updates are known (after the clip barrier; at
              the step's start without clipping) and written behind after their update;
              the update waits for its read, the next forward only for the update.
    frozen    with ``lora`` (train.method lora / qlora) the base items are frozen: they stream
              through the same slots but get no gradient, and only the adapters ``lora{i}``
              (runtime.lora) train, updated on the device after the backward; the
              backward of a layer computes its input and adapter gradients only, and the base
              layers still resident when a step ends serve the next forward without a copy.
              Base layers in the NVMe tier are read ahead in the order each window loads them
              (runtime.lora.BaseReader) and copied to their slots from the staging buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from slideformer.engine.dist.group import Single
from slideformer.engine.kernels import IGNORE
from slideformer.engine.kernels.fp8 import enabled as fp8_enabled
from slideformer.engine.kernels.attention import document_mask
from slideformer.engine.models.inputs import LayerInputs
from slideformer.engine.models.layers import decoder_layer
from slideformer.engine.models.moe import RouterAux
from slideformer.engine.models.lora import LoraForward, LoraSpec, dropout_seed
from slideformer.engine.models.model import embed
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.runtime.activations import DeviceStore, HostStore, SplitStore
from slideformer.engine.runtime.backward import WindowBackward
from slideformer.engine.runtime.ends import ResidentEnds
from slideformer.engine.runtime.grad_ring import GradRing, Speculation
from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, DeviceItem, HostItem, adam_update
from slideformer.engine.runtime.lora import BaseReader
from slideformer.engine.runtime.norms import NormMasters
from slideformer.engine.runtime.protocols import Backend
from slideformer.engine.runtime.regen import Regeneration
from slideformer.engine.runtime.shapes import DEVICE_CHUNK, ExecShape, regen_layers, speculative_layers
from slideformer.engine.runtime.slots import SlotPool
from slideformer.engine.runtime.timeline import StepTimeline
from slideformer.engine.runtime.updates import Guard, HostUpdates
from slideformer.engine.runtime.window import WindowItem, build_items, prefetch_disk


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
    pairs: object = None
    """A preference objective's PairStats of the step (train.objectives); None for SFT."""


class SlidingExecutor(ResidentEnds, WindowBackward):
    """Owns the device buffers and runs training steps over the host state."""

    def __init__(self, spec: ModelSpec, backend: Backend, host: dict[str, HostItem],
                 shape: ExecShape, compute_dtype: torch.dtype, lora: LoraSpec | None = None,
                 seed: int = 0, group=None, residual_dtype: torch.dtype | None = None,
                 fp8: bool = False):
        """``lora``: train the adapters ``lora{i}`` of ``host`` over a frozen base (``seed``
        seeds their dropout masks). ``group``: the ranks of a data-parallel run sharing
        ``host`` (slideformer.engine.dist.group); None: this process alone. ``residual_dtype``:
        the hidden states between layers, their gradients, activation checkpoints and RoPE tables
        (fp32 under bf16 compute: autocast's numerics, slideformer.engine.models.layers); None:
        the compute dtype. ``fp8``: the dense feed-forward's projections in row-wise FP8
        (train.precision = "fp8", slideformer.engine.kernels.fp8)."""
        self.spec, self.backend, self.host, self.shape = spec, backend, host, shape
        self.group = group or Single()
        self.dtype = compute_dtype
        self.act = residual_dtype or compute_dtype
        self.lora, self.seed, self.step_no = lora, seed, 0
        L, n = spec.num_layers, spec.params_per_layer
        self.k = max(1, min(shape.slots, L))
        self.ff_tile = shape.ff_tokens
        self.fp8 = fp8  # train.precision = "fp8": the MLP's projections (kernels.fp8)
        self.G = min(shape.device_layers, L)
        self.quant = getattr(host["layer0"], "quant", None) is not None
        """The decoder layers are NF4 (qlora): a slot holds a layer's NF4 bytes (its host
        item's ``quant`` layout), dequantised on the device into ``scratch`` when used; else
        slots hold the weights."""
        trained = lora is None  # a frozen base needs no gradient buffers of its own
        self._alloc_device_buffers(trained)
        disk = [i for i in range(L) if host[f"layer{i}"].disk is not None]
        self.regen = Regeneration(regen_layers(L, self.G, shape.regen_layers * trained))
        """With clipping, the layers whose gradient a second pass regenerates (runtime.regen)."""
        if set(disk) & set(self.regen.layers):
            raise ValueError("a layer in the NVMe tier cannot be regenerated (ExecShape.regen_layers)")
        self.snapshots = Speculation(host, speculative_layers(L, self.G, shape.spec_layers * trained,
                                                              disk + self.regen.layers),
                                     backend.host_alloc, lambda k, dt: torch.zeros(k, dtype=dt))
        # zeros, not empty: the pages are resident from the start, as the planner counts them,
        # even while steps clip early and skip speculating (tests/engine/plan/test_plan_rss.py)
        self.updates = HostUpdates(backend.is_cuda, self.snapshots, self.health_host, L, self.group)
        borrow = [i for i in range(self.G, L)  # device layers keep their gradient there
                  if trained and host[f"layer{i}"].g is None and i not in self.snapshots]
        self.gradless = [i for i in borrow if i not in self.regen]
        """Layers without a gradient of their own that clipping has no other way to serve."""
        # with clipping only the regenerated layers borrow, one at a time in pass 2
        ring = min(shape.grad_ring, L if self.gradless else len(borrow))
        self.ring = GradRing(backend.host_alloc, ring, n)
        resident = {"embed": (self.embed_w, self.embed_g), "head": (self.head_w, self.head_g)}
        self.items = build_items(host, L, backend, resident, shape.device_update, self.G, not trained)
        """Every item in update order: the embedding, the decoder layers, the head."""
        self.embed, *self.layers, self.head = self.items
        dev = self.dev
        wide = self.act != compute_dtype and not self.quant and lora is None
        self.norms = NormMasters(backend, spec, host, dev) if wide else None
        """With a wider residual stream, the norm weights in fp32 (engine.runtime.norms)."""
        self.dev_ws = None if not dev else AdamWorkspace(
            DEVICE_CHUNK, backend.device, next(iter(dev.values())).m.dtype != torch.float32)
        self.dev_loaded = False
        self.base = BaseReader()

    def _alloc_device_buffers(self, trained: bool) -> None:
        """Slots, the resident embedding and head, gradient slots, checkpoints, norms."""
        spec, backend, shape, dtype = self.spec, self.backend, self.shape, self.dtype
        L, n = spec.num_layers, spec.params_per_layer
        if not self.quant:  # n: the largest layer's parameters (layers may differ: spec.layout)
            self.pool = SlotPool(backend, self.k, n, dtype, L)
        else:
            nbytes = max(self.host[f"layer{i}"].quant.nbytes for i in range(L))
            self.pool = SlotPool(backend, self.k, nbytes, torch.uint8, L)
            self.scratch = backend.alloc(n, dtype)
        self.embed_w = backend.alloc(spec.embed_layout.numel, dtype)
        self.head_w = backend.alloc(spec.head_layout.numel, dtype)
        self.embed_g = backend.alloc(spec.embed_layout.numel, torch.float32) if trained else None
        self.head_g = backend.alloc(spec.head_layout.numel, torch.float32) if trained else None
        self.gslots = [backend.alloc(n, torch.float32) for _ in range(shape.grad_slots * trained)]
        self.gslot_free: list[list] = [[] for _ in self.gslots]
        """Per gradient slot: copies out of it that must finish before it is zeroed again."""
        ck = (backend, L, shape.n_micro, (shape.micro_batch, shape.seq_len, spec.hidden_size),
              self.act)
        on_gpu = min(shape.gpu_checkpoints, L) if shape.checkpoints == "host" else L
        self.store = DeviceStore(*ck) if on_gpu == L else HostStore(*ck) if not on_gpu else \
            SplitStore(*ck, on_gpu)
        self.norm_sq = backend.alloc((), torch.float32)
        self.health = backend.alloc(L + 1, torch.float32)
        self.health_host = backend.host_alloc(L + 1, torch.float32)

    @property
    def dev(self) -> dict[str, DeviceItem]:
        """The state updated on the device, by name (embed, head, device layers, adapters);
        drain() refreshes their host items."""
        return {d.name: d for item in [self.embed, self.head, *self.layers]
                for d in item.device_states()}

    @property
    def updater(self):
        """The pool the host updates run in (a thread under CUDA, at once on the CPU)."""
        return self.updates.pool

    @updater.setter
    def updater(self, pool) -> None:
        self.updates.pool = pool

    @property
    def step_updates(self) -> int:
        """Updates submitted by the current step so far (0 until its updates may start)."""
        return self.updates.submitted

    # ---- host <-> device state -------------------------------------------------------------
    def _ensure_device_state(self) -> None:
        """Copy the device-updated items' state from the host before their first use."""
        if self.dev and not self.dev_loaded:
            for item in self.dev.values():
                item.push()
            for item in (self.embed, self.head):
                if item.on_device:
                    item.stale = False
            self.dev_loaded = True

    def host_changed(self) -> None:
        """The host state was replaced (a checkpoint was read): reload the device-updated items."""
        self.dev_loaded = False

    def _weights(self, layer: int) -> torch.Tensor:
        if layer < self.G:
            return self.layers[layer].device.w
        host = self.layers[layer].host
        if not self.quant:
            return self.pool.acquire(layer, host.numel)
        # one scratch serves every layer: each use is queued on the compute stream after the last
        return host.quant.dequantize(self.pool.acquire(layer, host.quant.nbytes),
                                     self.scratch[:host.numel])

    def _refresh(self, item: WindowItem, tl: StepTimeline) -> None:
        """Bring an always-resident item up to date after its update."""
        self.updates.wait(item)
        if item.stale:
            h = self.backend.start_h2d(item.resident, item.host.w)
            tl.device_span("h2d", item.name, h.start, h)
            self.backend.compute_waits(h)
            item.stale = False
            if self.norms is not None and item.name == "head":
                self.norms.load(item.name)

    def _prefetch(self, layer: int, tl: StepTimeline) -> None:
        """Load a layer ahead of need only if its update already finished: the forward must not
        wait for the CPU optimizer on a layer it does not need yet (with K = L slots it would
        otherwise wait for every update before computing layer 0)."""
        fut = self.layers[layer].update
        if fut is None or fut.done():
            self._load(layer, tl)

    def _load(self, layer: int, tl: StepTimeline) -> None:
        if layer < self.G or self.pool.has(layer):
            return
        item = self.layers[layer]
        self.updates.wait(item)
        h = self.base.start_load(self.pool, layer, item.host, tl)
        tl.device_span("h2d", item.name, h.start, h)
        if self.norms is not None:
            self.norms.load(item.name)

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
        if max_grad_norm > 0 and self.gradless:
            raise ValueError("exact clipping needs every layer's gradient until the global norm is "
                             "known: build the host state with layer_grads=True (the speculative "
                             "and regenerated layers excepted)")
        self._ensure_device_state()
        tl = StepTimeline(self.backend, timeline)
        self.step_no = hyper(1.0).step
        clip = max_grad_norm > 0
        if not clip:  # the layer updates start in the backward, last layer first
            prefetch_disk(reversed(self.layers), tl)
        self.updates.start_step(max_grad_norm)
        tokens = sum(int((mb.labels != IGNORE).sum()) for mb in micro_batches)
        scale = 1.0 / max(tokens, 1)  # of the whole step: the ranks' gradients are summed
        kl = self._kl_references(micro_batches)
        inp = [self._inputs(mb) for mb in self.group.mine(micro_batches)]
        self.aux = self._router_aux(inp, len(micro_batches))
        self._refresh(self.embed, tl)
        xs = self.forward_window(inp, tl)
        self._refresh(self.head, tl)
        pairs = None
        if self.objective is None:
            loss, gys = self.head_step(xs, inp, scale, tl)
        elif self.objective[0] == "grpo":
            mine = self.group.mine(micro_batches)
            loss, gys = self.weighted_step(xs, inp, [mb.weights for mb in mine], tl, kl)
        else:
            mine = self.group.mine(micro_batches)
            loss, gys, pairs = self.preference_step(
                xs, inp, [mb.reference for mb in mine], tl,
                [mb.desirable for mb in mine] if self.objective[0] == "kto" else None)
        loss = loss + sum(a.value() for a in self.aux)
        self.group.reduce(loss)
        del xs  # the last hidden states are not needed in the backward
        if clip and self.snapshots.snaps:
            self._head_norm_to_host()
        guard = None
        if not clip and self.lora is None:  # frozen: every update waits for the backward
            guard = Guard.watch(self.backend, loss, self.health, self.health_host)
        self.backward_window(gys, inp, tl, None if clip else hyper(1.0), guard,
                             hyper(1.0) if clip and self.snapshots.snaps else None)
        norm = math.sqrt(float(self.norm_sq))  # the clip barrier: backward finished
        coef = min(1.0, max_grad_norm / (norm + 1e-6)) if clip else 1.0
        skipped = not (math.isfinite(norm) and math.isfinite(loss.item()))
        if skipped:  # keep the old weights; drop this step's gradients
            self.regen.drop()
            self.roll_back()
        else:
            if clip and self.regen:
                self._regenerate(inp, hyper(coef), tl)
            self._barrier_updates(hyper(coef), coef, clip, tl)
        if self.lora is None:  # a frozen base stays valid: its resident layers serve the next step
            self.pool.invalidate_all()
        self.group.step_done(self.wait_updates)
        applied = guard.applied if skipped and guard is not None else 0
        self.aux = ()
        return StepOutput(float(loss), norm, tokens, skipped, tl, applied, pairs)

    aux: tuple | list = ()
    """The step's router losses, one per micro-batch (models.moe.RouterAux), while it runs."""

    def _head_norm_to_host(self) -> None:
        """The head's squared gradient norm (final norm, and the LM head when untied: final once
        the head step ran) into the last entry of the host norms, ahead of the layers' copies
        on the same stream: speculation's partial norm starts from it, so a step that will
        clip stops speculating before its first speculative update instead of after the
        layers' own norms add up (runtime.updates.HostUpdates._may_speculate). The entry is
        the loss's under ``Guard``, which only steps without clipping use."""
        if self.head_g is None:  # a frozen head
            self.health[-1:].zero_()
        else:
            self.health[-1:].copy_(torch.linalg.vector_norm(self.head_g).square().reshape(1))
        self.backend.start_d2h(self.health_host[-1:], self.health[-1:], after=[self.backend.mark()])

    def _kl_references(self, micro_batches):
        """GRPO with a KL penalty (grpo.kl_beta > 0): (beta, [(norm, the base's token
        log-probabilities)] of this rank's micro-batches), the reference being the base with
        the adapters off (a forward pass each before the step's own); else None."""
        if self.objective is None or self.objective[0] != "grpo" or not self.objective[1].kl_beta:
            return None
        if self.lora is None:
            raise ValueError("GRPO's KL penalty needs a LoRA run: the base is its reference")
        return (self.objective[1].kl_beta,
                [(mb.norm, self.token_logps(mb, base=True)) for mb in self.group.mine(micro_batches)])

    def _router_aux(self, inp, n_micro: int) -> list:
        """A mixture of experts trained with its router loss: one RouterAux per micro-batch,
        weighted ``aux_coef / n_micro`` (the step's loss is the tokens' mean cross-entropy plus
        the coefficient times the micro-batches' mean aux; every token counts, as transformers
        counts them without an attention mask); [] otherwise."""
        moe = self.spec.moe
        if moe is None or not moe.aux_coef:
            return ()
        return [RouterAux(moe.experts, self.spec.sparse_layers, ids.numel(),
                          moe.aux_coef / n_micro, self.backend.device) for ids, *_ in inp]

    def _barrier_updates(self, hp: AdamHyper, coef: float, clip: bool, tl: StepTimeline) -> None:
        """Once the norm is known: the host updates that waited for it, in update order (their
        moments read ahead from disk in that order), then the device's."""
        kept = [item for item in self.layers if item.layer not in self.regen] if clip else []
        waiting = [self.embed, *kept, self.head]
        waiting = [item for item in waiting if not item.on_device and self.lora is None]
        prefetch_disk(waiting, tl)
        for item in waiting:
            self.updates.at_barrier(item, hp, coef, tl)
        self.updates.settled()
        self._device_updates(hp, tl)

    def roll_back(self) -> None:
        """Drop the current step: wait for its updates, undo its speculative ones (a skipped
        step, or one that failed in its backward)."""
        self.updates.roll_back(self.items)

    def _inputs(self, mb):
        dev = self.backend.device
        ids = mb.input_ids.to(dev, non_blocking=True)
        doc = None if mb.doc_ids is None else mb.doc_ids.to(dev, non_blocking=True)
        # one mask per layer type and micro-batch (a BlockMask on CUDA:
        # kernels.dispatch.kernel_path), reused by every layer's forward and recompute
        hd = self.spec.max_head_dim  # the widest layer's heads choose the path (Gemma 4)
        layers = LayerInputs.of_rows(self.spec, ids, doc, self.act,
                                     lambda d, w: document_mask(d, hd, w))
        return ids, mb.labels.to(dev, non_blocking=True), layers

    def forward_window(self, inp, tl: StepTimeline, save: bool = True) -> list[torch.Tensor]:
        """Layer-wise forward of every micro-batch; returns the last hidden states.

        ``save`` keeps each layer's inputs as activation checkpoints (training).
        """
        spec = self.spec
        emb = spec.embed_layout.views(self.embed_w)
        with torch.no_grad(), fp8_enabled(self.fp8):
            xs = [embed(spec, emb, ids).to(self.act) for ids, *_ in inp]
            for i, p in self.window_layers(tl):
                t0 = self.backend.mark()
                for mb, (_, _, layers) in enumerate(inp):
                    if save:
                        self.store.save(i, mb, xs[mb])
                    xs[mb] = decoder_layer(spec, p, xs[mb], *layers.at(i),
                                           lora=self._adapters(i, mb, save),
                                           aux=self.aux[mb] if save and self.aux else None,
                                           tile=self.ff_tile)
                tl.device_span("compute", self.layers[i].name, t0, self.backend.mark())
        return xs

    def window_layers(self, tl: StepTimeline):
        """(i, parameter views) of each decoder layer in order, through the slots: the next
        ``k - 1`` layers load while one computes, and a layer's slot is given back when the
        caller asks for the next (the forward's order; also GRPO's sampling, train.grpo)."""
        spec, L, k = self.spec, self.spec.num_layers, self.k
        self.pool.keep_only(range(self.G, self.G + k))  # after a forward: its last layers
        self._read_ahead(range(self.G, L), tl)
        for i in range(L):
            self._load(i, tl)
            ahead = max(i + 1, self.G)  # the device layers need no slot
            for j in range(ahead, min(ahead + k - 1, L)):
                self._prefetch(j, tl)
            yield i, self._norm_views(f"layer{i}", spec.layout(i).views(self._weights(i)))
            if i >= self.G:
                self.pool.release(i, evict=i < L - k)
        self.base.settle()

    def _read_ahead(self, layers, tl: StepTimeline) -> None:
        """Start reading the base weights on disk of the ``layers`` not in a slot, in order."""
        self.base.read_ahead([self.layers[i].host for i in layers if not self.pool.has(i)], tl)

    def _dropout_seed(self, layer: int, mb: int, train: bool) -> int | None:
        if not train or not self.lora.dropout:
            return None
        return dropout_seed(self.seed, self.step_no, layer, mb)

    def _adapters(self, layer: int, mb: int, train: bool) -> LoraForward | None:
        """The forward's view of a layer's adapters (None when the base is trained, or while
        the base alone runs: ends.token_logps)."""
        if self.lora is None or self.base_only:
            return None
        item = self.layers[layer].adapter
        return LoraForward(self.lora, item.layout.views(item.w), self._dropout_seed(layer, mb, train))

    def _device_updates(self, hp: AdamHyper, tl: StepTimeline) -> None:
        """AdamW of the device-updated items, queued on the compute stream after the backward."""
        dev = self.dev
        if not dev:
            return
        t0 = self.backend.mark()
        for item in dev.values():
            adam_update(item, hp, self.dev_ws, native=False)
        tl.device_span("compute", "device optimizer", t0, self.backend.mark())

    def wait_updates(self) -> None:
        """Wait for every update in flight."""
        for item in self.items:
            self.updates.wait(item)

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
        self.updates.shutdown()
