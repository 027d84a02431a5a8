"""The KV cache of a generation: keys and values of every layer, allocated once.

A layer's keys and values after RoPE are kept for every position seen so far, so each new token
costs one token's work per layer instead of the whole sequence's. The buffers are allocated at
the start for the longest sequence the request can reach (prompt + max new tokens): no
allocation while tokens stream. Per token the cache holds ``2 * kv_heads * head_dim`` values per
layer (SmolLM2-135M: 2 * 30 * 3 * 64 = 11,520, 45 KB in fp32; ModelSpec.kv_values_per_token),
each layer with its own head size and KV heads (Gemma 4's full-attention layers differ). Sliding layers keep every
position too and mask the ones outside their window (simple; a ring of ``window`` positions
would save memory on long chats). A gated DeltaNet layer (Qwen3.5) keeps no keys: its
:class:`StateCache` holds the recurrence's state, the same size whatever the length.
"""
from __future__ import annotations

import torch

from slideformer.engine.models.deltanet import zero_state
from slideformer.engine.models.spec import ModelSpec


class LayerCache:
    """One layer's keys and values, (B, kv_heads, capacity, head_dim) each."""

    def __init__(self, owner: "KVCache", shape: tuple[int, ...], dtype, device):
        self.owner = owner
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k, v (B, nkv, T, hd); return all of them so far."""
        start = self.owner.length
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache full: {end} positions, capacity {self.k.shape[2]}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class StateCache:
    """A gated DeltaNet layer's state after the tokens seen so far (models.deltanet): its
    causal convolution's last inputs and the recurrence's (key x value) memory per head."""

    def __init__(self, spec: ModelSpec, batch: int, device):
        self.shape, self.batch, self.device = spec.linear, batch, device
        self.state = None

    def begin(self, h: torch.Tensor):
        """The state the new tokens continue from (zeros before the first)."""
        if self.state is None:
            self.state = zero_state(self.shape, self.batch, h.dtype, self.device)
        return self.state

    def nbytes(self) -> int:
        s = self.shape
        return self.batch * (s.conv_dim * (s.conv_kernel - 1) * 2
                             + s.num_v_heads * s.head_k_dim * s.head_v_dim * 4)


class KVCache:
    """Every layer's cache and the number of positions they hold.

    The length moves on only through :meth:`advance`, once every layer has seen the new tokens
    (each layer's :meth:`LayerCache.extend` writes at the same offset).
    """

    def __init__(self, spec: ModelSpec, capacity: int, dtype, device, batch: int = 1):
        self.capacity = capacity
        self.length = 0
        self.layers = [StateCache(spec, batch, device) if spec.is_linear(i) else
                       LayerCache(self, (batch, spec.kv_heads_of(i), capacity, spec.head_dim_of(i)),
                                  dtype, device) for i in range(spec.num_layers)]

    def positions(self, t: int, device) -> torch.Tensor:
        """Positions (1, T) of the next ``t`` tokens."""
        return torch.arange(self.length, self.length + t, device=device)[None]

    def mask(self, t: int, device, window: int | None = None) -> torch.Tensor | None:
        """The attention mask of ``t`` new tokens over past + new keys (True = may attend);
        with a ``window``, a sliding layer's (a token sees itself and ``window - 1`` keys back).

        None where SDPA needs none: a single new token sees every key, and a first chunk with
        an empty cache is plainly causal (within the window, if any).
        """
        end = self.length + t
        if window is not None and end > window:
            # token j (absolute position length + j) sees keys length + j - window + 1 .. length + j
            return torch.ones(t, end, dtype=torch.bool, device=device).tril(
                self.length).triu(self.length - window + 1)
        if t == 1 or self.length == 0:
            return None
        # new token j (absolute position length + j) sees keys 0 .. length + j
        return torch.ones(t, end, dtype=torch.bool, device=device).tril(self.length)

    def advance(self, t: int) -> None:
        self.length += t

    def take_rows(self, part: "KVCache", row: int, copies: int) -> None:
        """Rows ``row`` .. ``row + copies - 1`` of this empty cache become ``copies`` copies of
        the one-row cache ``part`` (a prompt's prefill), its positions at the same slots; the
        slots between its length and this cache's :attr:`length` (once advanced) are zeroed,
        so that masked keys hold no stale values (a NaN times a zero weight is a NaN)."""
        n = part.length
        for mine, theirs in zip(self.layers, part.layers):
            if isinstance(mine, StateCache):
                if mine.state is None:
                    mine.state = zero_state(mine.shape, mine.batch, theirs.state[0].dtype,
                                            mine.device)
                for dst, src in zip(mine.state, theirs.state):
                    dst[row:row + copies] = src
            else:
                mine.k[row:row + copies, :, :n] = theirs.k[:, :, :n]
                mine.v[row:row + copies, :, :n] = theirs.v[:, :, :n]
                mine.k[row:row + copies, :, n:].zero_()
                mine.v[row:row + copies, :, n:].zero_()

    def nbytes(self) -> int:
        return sum(c.nbytes() if isinstance(c, StateCache) else 2 * c.k.numel() * c.k.element_size()
                   for c in self.layers)
