"""The generating forward pass and the token loop, over the engine's own layer maths.

:func:`forward` runs new tokens through the model with a KV cache (the same
:func:`slideformer.engine.models.layers.decoder_layer` as training, with its cache argument) and returns the
last position's logits. :func:`generate` feeds the prompt once (the prefill), then one token at
a time, choosing each with :mod:`slideformer.engine.generate.sampling`, until a stop token, the token limit,
or the caller's stop flag.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from slideformer.engine.generate.cache import KVCache
from slideformer.engine.generate.sampling import SamplingConfig, generator, next_token
from slideformer.engine.models.inputs import LayerInputs
from slideformer.engine.models.layers import decoder_layer
from slideformer.engine.models.model import embed, final_norm, head_weight, lm_logits
from slideformer.engine.models.spec import ModelSpec


@dataclass(frozen=True)
class Finished:
    """How a reply ended, and how fast it came."""

    reason: str
    """eos (the model ended its turn), length (max_new_tokens reached) or stopped (asked to)."""
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    """Seconds to run the prompt through the model (until the first new token's logits)."""
    decode_steps: int
    """Forward passes of one token each after the prompt's."""
    decode_s: float
    """Seconds from the prompt's logits to the end (the decode steps and the sampling)."""

    @property
    def tokens_per_s(self) -> float | None:
        """Decoding speed: one-token forward passes per second (None before the first)."""
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s > 0 \
            else None


@torch.no_grad()
def forward(spec: ModelSpec, weights, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (V,) in fp32 at the last of the new tokens ``ids`` (1, T); the cache grows by T."""
    return forward_rows(spec, weights, ids, cache)[0]


@torch.no_grad()
def forward_rows(spec: ModelSpec, weights, ids: torch.Tensor, cache: KVCache,
                 positions: torch.Tensor | None = None, masks: tuple | None = None) -> torch.Tensor:
    """Logits (B, V) in fp32 at the last of the new tokens ``ids`` (B, T) of B rows at the same
    positions (a cache of batch B); the cache grows by T. Rows at positions of their own (GRPO's
    prompts of different lengths: grpo.sample_groups) pass ``positions`` (B, T) and ``masks``
    (the full and the sliding layers' boolean masks over the cache's keys, (B, 1, T, S))."""
    emb = spec.embed_layout.views(weights.embed_w)
    head = spec.head_layout.views(weights.head_w)
    T = ids.shape[1]
    x = embed(spec, emb, ids)  # (1, T, H)
    window = spec.sliding_window
    if positions is None:
        positions = cache.positions(T, ids.device)
        masks = (cache.mask(T, ids.device),
                 None if window is None else cache.mask(T, ids.device, window))
    inp = LayerInputs(spec, positions, x.dtype, *masks)
    for i, p in enumerate(weights.layers()):  # to the end: a streamed window frees its slots
        x = decoder_layer(spec, p, x, *inp.at(i), cache.layers[i], lora=weights.adapters(i))
    cache.advance(T)
    h = final_norm(spec, head["norm.weight"], x[:, -1])  # (B, H)
    return lm_logits(spec, h, head_weight(spec, head, emb)).float()


def generate(spec: ModelSpec, weights, prompt: list[int], cfg: SamplingConfig,
             stop_ids: frozenset[int], device, dtype,
             should_stop: Callable[[], bool] = lambda: False) -> Iterator[int | Finished]:
    """Yield each new token id as it is chosen, then one :class:`Finished`.

    A stop token ends the reply and is not yielded. ``should_stop`` is asked before each new
    token (a Stop button, a new request).
    """
    capacity = min(len(prompt) + cfg.max_new_tokens, spec.max_position_embeddings)
    cache = KVCache(spec, capacity, dtype, device)
    gen = generator(cfg.seed, device)
    t0 = time.perf_counter()
    logits = forward(spec, weights, torch.tensor([prompt], device=device), cache)
    t1 = time.perf_counter()
    n, steps, reason = 0, 0, "length"
    while True:
        if should_stop():
            reason = "stopped"
            break
        tok = next_token(logits, cfg, gen)
        if tok in stop_ids:
            reason = "eos"
            break
        n += 1
        yield tok
        if n >= cfg.max_new_tokens or cache.length >= capacity:
            break
        logits = forward(spec, weights, torch.tensor([[tok]], device=device), cache)
        steps += 1
    yield Finished(reason, len(prompt), n, t1 - t0, steps, time.perf_counter() - t1)
