"""The backward half of the sliding executor (runtime.executor): layer L-1 down to 0, each
recomputed from its activation checkpoint with autograd, its gradients accumulated over the
micro-batches in one device buffer and sent to the host (or, for device layers and adapters,
kept for the device update), the clipping norm summed on the way; with exact clipping the
regenerated layers' second pass (runtime.regen). A mixin of SlidingExecutor: it uses the
executor's slots, stores, rings and update queue."""
from __future__ import annotations

import math

import torch

from slideformer.engine.kernels.fp8 import enabled as fp8_enabled
from slideformer.engine.kernels.dispatch import fp32_accumulate
from slideformer.engine.models.layers import decoder_layer, ff_block, mixer_block, tiles
from slideformer.engine.models.recompute import (layer_backward, query_tiled_grads, query_tiles,
                                                 tiled_grads)
from slideformer.engine.models.lora import LoraForward
from slideformer.engine.models.spec import Layout
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.timeline import StepTimeline
from slideformer.engine.runtime.updates import Guard
from slideformer.engine.runtime.window import WindowItem


def grads_into(layout: Layout, g: torch.Tensor, dtype: torch.dtype) -> dict:
    """The fp32 views of a layer's gradient buffer ``g`` (of ``layout``) that its projection weights' backward
    matmuls add to directly (kernels.dispatch.fp32_accumulate: CUDA, ``dtype`` 16-bit); {}
    elsewhere, where autograd returns those gradients and they are added afterwards."""
    if not (g.is_cuda and dtype != torch.float32 and fp32_accumulate("cuda")):
        return {}
    return {n: g[o:o + math.prod(sh)].view(sh) for n, o, sh in layout.entries
            if n.endswith("_proj.weight") and len(sh) == 2}  # stacked experts: autograd's


class WindowBackward:
    """Backward through the window and the gradients' way out (mixed into SlidingExecutor)."""

    def backward_window(self, gys, inp, tl: StepTimeline, hyper_now: AdamHyper | None,
                        guard: Guard | None = None, hyper_spec: AdamHyper | None = None) -> None:
        """Layer-wise backward with recompute; gradients leave for the host one layer at a time.

        With ``hyper_now`` (no clipping) each layer's update is submitted at once, behind
        ``guard``'s check of its gradient norm; with ``hyper_spec`` (clipping) the speculative
        layers' updates are.
        """
        L = self.spec.num_layers
        watched = guard is not None or hyper_spec is not None  # norms on the host, per layer
        self._read_ahead(reversed(range(self.G, L)), tl)
        regen = hyper_now is None and self.lora is None  # clipping: pass 2 regenerates them
        for i in reversed(range(L)):
            if regen:
                self.regen.keep(i, gys)
            g, slot, t0 = self._layer_grads(i, gys, inp, tl, 0)
            sq = torch.linalg.vector_norm(g).square()
            self.norm_sq += sq
            if watched:
                self.health[i].copy_(sq)
            t1 = self.backend.mark()
            tl.device_span("compute", self.layers[i].name, t0, t1)
            if self.lora is not None:  # frozen: nothing leaves; the low layers stay for the next step
                self.pool.release(i, evict=i >= self.k)
            elif regen and i in self.regen:  # for the norm only: pass 2 computes it again
                self.pool.release(i, evict=True)
            elif i >= self.G:
                self.gslot_free[slot] = self._send_grad(self.layers[i], g, t1, tl, hyper_now, guard,
                                                        hyper_spec, watched)
                self.pool.release(i, evict=True)
            self.store.done_with(i)
        self.base.settle()
        self._embed_backward(gys, inp, tl)


    def _layer_grads(self, i: int, gys, inp, tl: StepTimeline, lowest: int):
        """Load layer ``i`` (and the next ones down to ``lowest``), recompute and backpropagate
        every micro-batch into its gradient buffer, replacing ``gys``; returns (the buffer, its
        gradient slot, the compute's start mark)."""
        if i - 1 >= lowest:
            self.store.prefetch(i - 1)
        for j in range(i, max(i - self.k, lowest - 1), -1):
            self._load(j, tl)
        w = self._weights(i)
        g, slot = self._grad_buffer(i)
        g.zero_()
        t0 = self.backend.mark()
        for mb, (_, _, layers) in enumerate(inp):
            gys[mb] = self._layer_backward(w, g, self.store.load(i, mb), gys[mb], *layers.at(i), i, mb)
        self.group.reduce(g)
        return g, slot, t0


    def _regenerate(self, inp, hp: AdamHyper, tl: StepTimeline) -> None:
        """Pass 2 (runtime.regen): the regenerated layers' backward again from the boundary;
        each gradient goes through the ring with its update, coefficient known, at once."""
        gys, lowest = self.regen.take(), self.regen.layers[0]
        for i in reversed(self.regen.layers):
            g, slot, t0 = self._layer_grads(i, gys, inp, tl, lowest)
            t1 = self.backend.mark()
            tl.device_span("compute", self.layers[i].name, t0, t1)
            self.gslot_free[slot] = self._send_grad(self.layers[i], g, t1, tl, hp, None, None, False)
            self.pool.release(i, evict=True)
            self.store.done_with(i)


    def _grad_buffer(self, layer: int) -> tuple[torch.Tensor, int | None]:
        """Where layer's gradient accumulates on the device, and its gradient slot (if any)."""
        item = self.layers[layer]
        if item.adapter is not None:  # the adapters' gradient buffer, on the device
            return item.adapter.g, None
        if item.on_device:  # its own gradient buffer, read by the device update on this stream
            return item.device.g, None
        slot = layer % len(self.gslots)
        for h in self.gslot_free[slot]:
            self.backend.compute_waits(h)
        return self.gslots[slot][:self.spec.layout(layer).numel], slot


    def _send_grad(self, item: WindowItem, g: torch.Tensor, t1, tl: StepTimeline, hyper_now,
                   guard, hyper_spec, watched: bool) -> list:
        """Copy a layer's gradient (and, if ``watched``, its squared norm) to the host and submit
        the update it may start now; returns the copy's handle (the gradient slot is free once
        it is done)."""
        i, n = item.layer, self.spec.layout(item.layer).numel
        dest, r = item.host.g, None
        if i in self.snapshots:
            dest = self.snapshots.grad(i, n)
        elif dest is None:  # a ring buffer, once the update that last read it is done
            r, dest = self.ring.take(n)
        part = self.group.span(n)  # the slice whose update this rank owns
        h = self.backend.start_d2h(dest[part], g[part], after=[t1])
        tl.device_span("d2h", item.name, h.start, h)
        item.grads_out = [h]
        if watched:
            item.grads_out.append(self.backend.start_d2h(
                self.health_host[i:i + 1], self.health[i:i + 1], after=[t1]))
        if hyper_now is not None:
            self.updates.submit(item, hyper_now, tl, guard, dest)
            if r is not None:
                self.ring.used_by(r, item.update)
        elif hyper_spec is not None and i in self.snapshots:
            self.updates.submit(item, hyper_spec, tl, grad=dest, speculative=True)
        return [h]


    def _layer_backward(self, w, g, x, gy, rope, mask, layer: int = 0, mb: int = 0) -> torch.Tensor:
        """Recompute one layer for one micro-batch, add its trained parameters' grads (the
        layer's, or with a frozen base its adapters') to g; return dL/dx."""
        with fp8_enabled(self.fp8):  # train.precision = "fp8"
            spec = self.spec
            base = self._norm_views(f"layer{layer}", spec.layout(layer).views(w))
            aux = self.aux[mb] if self.aux else None
            if self.lora is None:  # the recompute skips the layer's output (layer_backward)
                into = grads_into(spec.layout(layer), g, w.dtype)
                leaves = {k: v.detach() if k in into else v.detach().requires_grad_()
                          for k, v in base.items()}
                gx, grads = layer_backward(spec, leaves, x, gy, rope, mask, into, aux,
                                           self.ff_tile)
                layout = spec.layout(layer).only(grads)
                grads = list(grads.values())
            else:
                item = self.layers[layer].adapter
                layout = item.layout
                leaves = {k: v.detach().requires_grad_() for k, v in layout.views(item.w).items()}
                adapters = LoraForward(self.lora, leaves, self._dropout_seed(layer, mb, True))
                x = x.detach().requires_grad_()
                if query_tiles(spec, base, x, mask, self.ff_tile, aux, adapters):
                    gx, grads = query_tiled_grads(
                        spec, base, lambda m: ff_block(spec, base, m, adapters), x, gy,
                        list(leaves.values()), rope, mask, self.ff_tile, adapters)
                elif tiles(self.ff_tile, x, aux, adapters):
                    gx, grads = tiled_grads(
                        lambda v: mixer_block(spec, base, v, rope, mask, lora=adapters),
                        lambda m: ff_block(spec, base, m, adapters), x, gy, list(leaves.values()),
                        self.ff_tile)
                else:
                    with torch.enable_grad():
                        y = decoder_layer(spec, base, x, rope, mask, lora=adapters, aux=aux)
                        terms = aux.take() if aux is not None else []
                        gx, *grads = torch.autograd.grad([y, *terms], [x, *leaves.values()],
                                                         [gy, *(torch.ones_like(t) for t in terms)])
            for (_, off, _), gp in zip(layout.entries, grads):
                g[off:off + gp.numel()].add_(gp.reshape(-1))
            return gx
