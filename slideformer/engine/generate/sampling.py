"""Choosing the next token: greedy, or sampled with temperature and top-p (nucleus), seeded.

The filtering follows the usual definition (the one ``transformers``' temperature and top-p
logits processors implement, which the tests compare against): logits are divided by the
temperature; the smallest set of most likely tokens whose probabilities sum to at least
``top_p`` is kept (at least one token); the rest get probability zero.

The draw runs where the logits are, for every row of a batch at once (GRPO samples a prompt's G
replies together): each row draws V exponential variates E_v from its own seeded generator and
takes argmax_v p_v / E_v. That is an exact draw from p (the "exponential race": the smallest of
independent E_v / p_v is at v with probability p_v), the same as ``torch.multinomial``'s in
distribution, and it needs no copy of the probabilities to the host nor one host sync per row:
a step of G rows reads its G tokens back in one transfer. A row's tokens depend only on its own
seed and logits, never on the other rows of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slideformer.engine.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    """How one reply is generated."""

    temperature: float = 0.7
    """Logits are divided by this; 0 means greedy (always the most likely token)."""
    top_p: float = 0.9
    """Nucleus sampling: keep the most likely tokens up to this total probability (0 < p <= 1)."""
    max_new_tokens: int = 256
    """The reply stops after this many tokens if the model has not ended it."""
    seed: int = 0
    """Seed of the sampler: the same prompt, settings and seed give the same reply."""

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise UserError("temperature", f"is {self.temperature}", "use 0 (greedy) or more")
        if not (0 < self.top_p <= 1):
            raise UserError("top_p", f"is {self.top_p}", "use a value in (0, 1]")
        if self.max_new_tokens < 1:
            raise UserError("max_new_tokens", f"is {self.max_new_tokens}", "use 1 or more")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Scaled logits (..., V) with the tokens outside the top-p nucleus set to -inf."""
    scaled = logits.float() / temperature
    if top_p >= 1.0:
        return scaled
    probs, order = scaled.softmax(-1).sort(-1, descending=True)
    # drop a token when the tokens more likely than it already reach top_p
    before = probs.cumsum(-1) - probs
    drop = before >= top_p
    drop[..., 0] = False
    return scaled.scatter(-1, order, scaled.gather(-1, order).masked_fill(drop, float("-inf")))


def generator(seed: int, device) -> torch.Generator:
    """A seeded generator on ``device`` (the logits' device: draws never leave it)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def next_tokens(logits: torch.Tensor, cfgs: list[SamplingConfig],
                gens: list[torch.Generator]) -> list[int]:
    """The next token of each row of ``logits`` (B, V), row b by ``cfgs[b]`` with ``gens[b]``
    (on the logits' device): one read back to the host for the batch."""
    V = logits.shape[-1]
    race = torch.empty_like(logits, dtype=torch.float32)
    for b, (cfg, gen) in enumerate(zip(cfgs, gens)):
        if cfg.greedy:
            race[b] = logits[b].float()
        else:
            probs = filter_logits(logits[b], cfg.temperature, cfg.top_p).softmax(-1)
            race[b] = probs / torch.empty(V, device=logits.device).exponential_(generator=gen)
    return race.argmax(-1).tolist()


def next_token(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> int:
    """The next token id from the last position's logits (V,) (:func:`next_tokens` of one row)."""
    return next_tokens(logits[None], [cfg], [gen])[0]
