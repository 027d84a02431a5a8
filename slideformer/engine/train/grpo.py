"""GRPO (Group Relative Policy Optimization; Shao et al. 2024, "DeepSeekMath", section 4.1).

For each prompt q of a step, G = grpo.group_size replies o_1..o_G are sampled from the weights
being trained and scored r_i by the reward. A reply's advantage is its reward normalised within
its group (TRL's GRPOTrainer: the unbiased standard deviation, 1e-4 added):

    A_i = (r_i - mean_j r_j) / (std_j r_j + 1e-4)

The step then takes one optimizer step on these replies (on-policy: the importance ratio of the
clipped surrogate is 1, its gradient A_i grad log pi), the loss over the step's P prompts being

    L = -1 / (P G) * sum_q sum_i 1 / |o_i| * sum_t A_i log pi(o_i,t | q, o_i,<t)

so every reply token's cross-entropy is weighted A_i / (P G |o_i|): one weighted cross-entropy
backward over the head gives the exact gradient (runtime.ends). A reply's tokens are the sampled
ids themselves (never re-tokenised text), its stop token included when it stopped: the model
learns to end its replies. The loss's value is near zero by construction (a group's
advantages sum to zero); the run reports the rewards (RolloutMetrics).

KL penalty (grpo.kl_beta = beta > 0, LoRA and QLoRA runs): DeepSeekMath's per-token estimator
D_t = pi_ref/pi - log(pi_ref/pi) - 1 to the base model (the adapters off: no second copy),
added to the loss as beta / (P G |o_i|) * sum_t D_t (runtime.ends.weighted_step); the base's
token log-probabilities come from one forward pass of the replies before the step. A full
fine-tune's reference would be the initial weights beside the trained ones: refused.

Prompts (``data.train``): ``{"prompt": str or messages, "answer": str, ...}``, or a chat record
``{"messages": [..., assistant]}`` whose last reply is the answer and the rest the prompt (the
SFT demo task trains as is). A plain-string prompt is BOS + its tokens; messages are rendered
with the chat template and the generation prompt.

Rewards: a Python file (``grpo.reward``) defining ``reward(prompt, completion, record) ->
float``, or the answer check: 1.0 when the first group of ``grpo.answer_regex`` found in the
reply equals the record's answer, both stripped.

Replies are sampled with a seed per (data seed, epoch, step of the epoch, prompt, reply), so a
resumed run samples what the uninterrupted one sampled. A full fine-tune samples from its
weights made resident on the device for the rollouts; LoRA and QLoRA sample through their
training window. grpo.prompts_together prompts' groups decode as one batch
(:func:`sample_groups`), each prompt prefilled alone.
"""
from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from slideformer.engine.config import DataConfig, GrpoConfig
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.conversation import Conversation
from slideformer.engine.data.dataset import MicroBatch
from slideformer.engine.data.records import Record, RecordReader, source_files
from slideformer.engine.data.stream import same_position
from slideformer.engine.errors import UserError
from slideformer.engine.generate.cache import KVCache
from slideformer.engine.generate.decoder import forward, forward_rows
from slideformer.engine.generate.sampling import SamplingConfig, generator, next_token, next_tokens
from slideformer.engine.kernels import IGNORE

_FIX = ('write each record as {"prompt": ..., "answer": ...} (the prompt a string or a list of '
        'messages), or as {"messages": [...]} ending with the assistant\'s answer')


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    """The prompt's tokens, ready for the reply."""
    text: str
    """The prompt as the reward sees it (the rendered conversation, or the string)."""
    answer: str | None
    record: dict
    where: str


@dataclass
class GrpoBatch(MicroBatch):
    """Sampled replies, one a row after its prompt; ``weights`` (rows,) A_i / (P G |o_i|),
    ``norm`` (rows,) 1 / (P G |o_i|)."""

    weights: torch.Tensor = None
    norm: torch.Tensor = None


@dataclass(frozen=True)
class RolloutStats:
    reward_mean: float
    reward_std: float
    """Over every reply of the step."""
    reply_tokens: float
    """Mean tokens of a reply."""
    seconds: float
    """Sampling time of the step."""


# ---- prompts ------------------------------------------------------------------------------------
def read_prompts(cfg: DataConfig, tok, renderer: ChatRenderer) -> list[Prompt]:
    """Every prompt of ``cfg.train`` (see the module docstring), checked and tokenized."""
    prompts = [_prompt(rec, tok, renderer, cfg.max_seq_len)
               for rec in RecordReader(source_files(cfg.train), cfg.max_samples)]
    if not prompts:
        raise UserError(cfg.train, "holds no prompts", _FIX)
    return prompts


def _prompt(rec: Record, tok, renderer: ChatRenderer, limit: int) -> Prompt:
    v = rec.value
    if not isinstance(v, dict):
        raise UserError(rec.where, "is not a prompt record (a JSON object)", _FIX)
    prompt, answer = v.get("prompt"), v.get("answer")
    if prompt is None and isinstance(v.get("messages"), list) and v["messages"]:
        *prompt, last = v["messages"]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise UserError(rec.where, "has messages that do not end with the assistant's "
                            "answer", _FIX)
        answer = last.get("content") if answer is None else answer
    if answer is not None and not isinstance(answer, str):
        raise UserError(rec.where, f"has an 'answer' that is {type(answer).__name__}, not text",
                        "write the answer as a string")
    if isinstance(prompt, str) and prompt:
        bos = [tok.bos_id] if tok.bos_id is not None else []
        ids, text = bos + tok.tok.encode(prompt, add_special_tokens=False).ids, prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt):
        try:  # the run's template and thinking switch (data.chat_template, enable_thinking)
            text = renderer.render(Conversation(prompt, (False,) * len(prompt)),
                                   add_generation_prompt=True)
        except UserError as e:
            raise UserError(rec.where, f"cannot be rendered with the chat template ({e.problem})",
                            "fix the record's messages") from None
        ids = tok.encode(text)
    else:
        raise UserError(rec.where, "has no prompt (a non-empty string or list of "
                        "{\"role\", \"content\"} messages)", _FIX)
    if len(ids) >= limit:
        raise UserError(rec.where, f"has a prompt of {len(ids):,} tokens, which leaves no room "
                        f"for a reply within data.max_seq_len = {limit:,}",
                        "raise data.max_seq_len, or shorten or remove the record")
    return Prompt(ids, text, answer, v, rec.where)


# ---- rewards ------------------------------------------------------------------------------------
def reward_function(cfg: GrpoConfig, prompts: list[Prompt]) -> Callable[[Prompt, str], float]:
    """``score(prompt, completion) -> float`` from grpo.reward's file, or the answer check."""
    if cfg.reward:
        return _file_reward(Path(cfg.reward).expanduser())
    missing = next((p for p in prompts if p.answer is None), None)
    if missing is not None:
        raise UserError(missing.where, "has no 'answer' for the answer check",
                        "give every record an \"answer\", or a reward file (grpo.reward)")
    pattern = re.compile(cfg.answer_regex)

    def check(p: Prompt, completion: str) -> float:
        m = pattern.search(completion)
        got = (m.group(1) if m and m.groups() else m.group(0) if m else None)
        return float(got is not None and got.strip() == p.answer.strip())
    return check


def _file_reward(path: Path) -> Callable[[Prompt, str], float]:
    fix = "define reward(prompt, completion, record) -> float in that file"
    if not path.is_file():
        raise UserError(path, "is not a file (grpo.reward)", fix)
    spec = importlib.util.spec_from_file_location("slideformer_grpo_reward", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error is theirs to fix, named
        raise UserError(path, f"failed to load: {type(e).__name__}: {e}", fix) from None
    fn = getattr(module, "reward", None)
    if not callable(fn):
        raise UserError(path, "defines no reward function", fix)

    def call(p: Prompt, completion: str) -> float:
        try:
            r = fn(p.text, completion, p.record)
        except Exception as e:
            raise UserError(path, f"reward() raised {type(e).__name__}: {e} on the record "
                            f"{p.where}", "make reward() return a number for every record") \
                from None
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise UserError(path, f"reward() returned {r!r} for the record {p.where}",
                            "return a finite number")
        return float(r)
    return call


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(P, G) group-normalised advantages of (P, G) rewards (module docstring)."""
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    return (rewards - mean) / (std + 1e-4)


# ---- sampling -----------------------------------------------------------------------------------
@torch.no_grad()
def sample_reply(spec, weights, prompt: list[int], cfg: SamplingConfig, stop_ids: frozenset,
                 device, dtype) -> tuple[list[int], bool]:
    """(the reply's token ids, whether it ended with a stop token, which is the last id)."""
    cache = KVCache(spec, len(prompt) + cfg.max_new_tokens, dtype, device)
    gen = generator(cfg.seed, device)
    logits = forward(spec, weights, torch.tensor([prompt], device=device), cache)
    out: list[int] = []
    while len(out) < cfg.max_new_tokens:
        tok = next_token(logits, cfg, gen)
        out.append(tok)
        if tok in stop_ids:
            return out, True
        logits = forward(spec, weights, torch.tensor([[tok]], device=device), cache)
    return out, False


@torch.no_grad()
def sample_group(spec, weights, prompt: list[int], cfgs: list[SamplingConfig],
                 stop_ids: frozenset, device, dtype) -> list[tuple[list[int], bool]]:
    """The replies to one prompt for each of ``cfgs`` (their seeds), decoded together: the
    prompt runs once as a batch of G identical rows, then each forward takes one token of every
    row, so a step of decoding reads the weights once for G replies instead of G times. Each
    row samples with its own seeded generator, as :func:`sample_reply` would alone; a row that
    has ended is fed its last token again and what follows is dropped."""
    G, n = len(cfgs), max(c.max_new_tokens for c in cfgs)
    cache = KVCache(spec, len(prompt) + n, dtype, device, batch=G)
    gens = [generator(c.seed, device) for c in cfgs]
    logits = forward_rows(spec, weights, torch.tensor([prompt] * G, device=device), cache)
    out: list[list[int]] = [[] for _ in range(G)]
    ended = [False] * G
    while True:
        live = [g for g in range(G) if not ended[g]]  # an ended row draws nothing more
        for g, tok in zip(live, next_tokens(logits[live], [cfgs[g] for g in live],
                                            [gens[g] for g in live])):
            out[g].append(tok)
            ended[g] = tok in stop_ids or len(out[g]) >= cfgs[g].max_new_tokens
        if all(ended):
            return [(o, o[-1] in stop_ids) for o in out]
        last = torch.tensor([[o[-1]] for o in out], device=device)
        logits = forward_rows(spec, weights, last, cache)


@torch.no_grad()
def sample_groups(spec, weights, prompts: list[list[int]], cfgs: list[list[SamplingConfig]],
                  stop_ids: frozenset, device, dtype) -> list[list[tuple[list[int], bool]]]:
    """The replies to several prompts (``cfgs[q]``: prompt q's seeds), every row decoded in one
    batch: a decode step reads the weights once for all the prompts' replies. Each prompt runs
    its prefill alone (one row) into a cache of its own, copied into its rows of the shared
    cache at slots 0 .. len(q) - 1; the decode steps write every row at the same slot
    max_len + t, each row with its own RoPE position len(q) + t and a mask over its keys (its
    prompt's slots and the decoded ones; sliding layers: by position, within the window). Each
    row samples with its own seeded generator, as :func:`sample_reply` would alone; a row that
    has ended is fed its last token again and what follows is dropped."""
    if len(prompts) > 1 and dict(spec.rope_scaling or ()).get("rope_type") == "longrope":
        # LongRoPE picks its factors by the longest position of the whole forward: rows of
        # other prompts would change a row's rotation; one prompt's group at a time
        return [sample_group(spec, weights, p, cs, stop_ids, device, dtype)
                for p, cs in zip(prompts, cfgs)]
    rows = [c for cs in cfgs for c in cs]
    lens = [len(p) for p, cs in zip(prompts, cfgs) for _ in cs]
    L, n = max(lens), max(c.max_new_tokens for c in rows)
    cache = KVCache(spec, L + n, dtype, device, batch=len(rows))
    first, r = [], 0
    for p, cs in zip(prompts, cfgs):
        part = KVCache(spec, len(p), dtype, device)
        first.append(forward_rows(spec, weights, torch.tensor([p], device=device), part)
                     .expand(len(cs), -1))
        cache.take_rows(part, r, len(cs))
        r += len(cs)
    cache.advance(L)
    logits = torch.cat(first)
    length = torch.tensor(lens, device=device)[:, None]  # (R, 1)
    gens = [generator(c.seed, device) for c in rows]
    out: list[list[int]] = [[] for _ in rows]
    ended = [False] * len(rows)
    window = spec.sliding_window
    for t in range(n + 1):
        live = [g for g in range(len(rows)) if not ended[g]]
        for g, tok in zip(live, next_tokens(logits[live], [rows[g] for g in live],
                                            [gens[g] for g in live])):
            out[g].append(tok)
            ended[g] = tok in stop_ids or len(out[g]) >= rows[g].max_new_tokens
        if all(ended):
            break
        slot = torch.arange(L + t + 1, device=device)[None]  # (1, S): the keys after this write
        pos = length + t  # (R, 1): the new token's position
        seen = (slot < length) | (slot >= L)
        key_pos = torch.where(slot < L, slot, slot - L + length)
        sliding = None if window is None else (seen & (pos - key_pos < window))[:, None, None]
        logits = forward_rows(spec, weights, torch.tensor([[o[-1]] for o in out], device=device),
                              cache, pos, (seen[:, None, None], sliding))
    groups, r = [], 0
    for cs in cfgs:
        groups.append([(o, o[-1] in stop_ids) for o in out[r:r + len(cs)]])
        r += len(cs)
    return groups


def replies_batch(prompts: list[Prompt], replies: list[list[int]], adv: torch.Tensor,
                  seq_len: int, pad_id: int, P: int, G: int) -> GrpoBatch:
    """Row r: ``prompts[r]`` + ``replies[r]`` (cut at ``seq_len``), the reply's tokens the
    targets, weighted ``adv[r]`` / (P G |o_r|)."""
    ids = np.full((len(replies), seq_len), pad_id, np.int64)
    labels = np.full((len(replies), seq_len), IGNORE, np.int64)
    norm = torch.zeros(len(replies))
    for r, (prompt, reply) in enumerate(zip(prompts, replies)):
        start = len(prompt.ids)
        row = (prompt.ids + reply)[:seq_len]
        ids[r, :len(row)] = row
        labels[r, start - 1:len(row) - 1] = row[start:]
        norm[r] = 1.0 / (P * G * max(len(row) - start, 1))
    return GrpoBatch(torch.from_numpy(ids), torch.from_numpy(labels), None,
                     weights=adv.float() * norm, norm=norm)


class PolicyReader:
    """The weights being trained, for sampling (generate.window's reader protocol): each item's
    fp32 master from the host state (dequantised for a QLoRA base), a LoRA run's adapters folded
    in (GRPO samples those through :class:`WindowWeights` instead; the tests compare the two).
    The executor must be drained first (its updates finished, device items pulled)."""

    def __init__(self, host: dict, lora):
        self.host, self.lora = host, lora

    def read_item(self, spec, item: str, out: torch.Tensor) -> torch.Tensor:
        from slideformer.engine.train.lora_export import merged_item
        flat = self.host[item].master() if self.lora is None else \
            merged_item(self.host, spec, self.lora, item)
        return out.copy_(flat)

    def close(self) -> None:
        pass


class WindowWeights:
    """A LoRA or QLoRA run's own window as the sampling model (generate.decoder's weights
    protocol): the frozen base through the executor's slots, as its forward reads it (NF4
    dequantised on the device, layers on the NVMe tier read ahead), the adapters where they
    train, on the device. Nothing is copied or merged for sampling: the base is resident when
    the slots hold every layer and streamed through them when not, and the memory is the
    training step's own."""

    mode = "window"

    def __init__(self, executor):
        from slideformer.engine.runtime.timeline import StepTimeline
        self.ex, self.embed_w, self.head_w = executor, executor.embed_w, executor.head_w
        self.tl = StepTimeline(executor.backend, enabled=False)

    def layers(self):
        for _, p in self.ex.window_layers(self.tl):
            yield p

    def adapters(self, layer: int):
        return self.ex._adapters(layer, 0, False)


class Sampler:
    """``policy.groups(prompts, seeds) -> [[(reply ids, stopped)] per prompt]`` of a GRPO run,
    with the weights being trained, once ``executor.drain()`` finished the step's updates
    (:meth:`start`; :meth:`done` before the step trains). A full fine-tune's model is made
    resident for the sampling from the host state (fp32 masters, in the compute dtype) and
    freed after; a LoRA or QLoRA run samples through its own window (:class:`WindowWeights`).
    Sampling stops at the tokenizer's eos or the chat template's end-of-turn token."""

    def __init__(self, spec, host: dict, lora, backend, dtype, tok, cfg: GrpoConfig,
                 seq_len: int, executor):
        from slideformer.engine.generate.session import end_of_turn_ids
        self.spec, self.host, self.lora, self.backend, self.dtype = spec, host, lora, backend, dtype
        self.cfg, self.seq_len, self.executor = cfg, seq_len, executor
        eos = {tok.eos_id} if tok.eos_id is not None else set()
        self.stops = frozenset(eos | end_of_turn_ids(tok))
        self.weights = None

    def start(self) -> None:
        from slideformer.engine.generate.window import ResidentWeights
        self.executor.drain()
        self.weights = WindowWeights(self.executor) if self.lora is not None else \
            ResidentWeights(self.spec, PolicyReader(self.host, None), self.dtype, self.backend)

    def done(self) -> None:
        self.weights = None

    def groups(self, prompts: list[list[int]], seeds: list[list[int]]
               ) -> list[list[tuple[list[int], bool]]]:
        """One reply per seed to each prompt, all decoded as one batch (:func:`sample_groups`)."""
        g = self.cfg
        cfgs = [[SamplingConfig(temperature=g.temperature, top_p=g.top_p, seed=seed,
                                max_new_tokens=min(g.max_new_tokens, self.seq_len - len(p)))
                 for seed in ss] for p, ss in zip(prompts, seeds)]
        return sample_groups(self.spec, self.weights, prompts, cfgs, self.stops,
                             self.backend.device, self.dtype)


class GrpoStream:
    """Steps of P = micro_batch x grad_accum / G prompts, each sampled G times by ``policy``
    (a :class:`Sampler`: ``start()``, then ``policy.groups(prompts' ids, their seeds) ->
    [[(reply ids, stopped)] per prompt]`` for grpo.prompts_together prompts at a time, then
    ``done()``); the prompts reshuffled (seeded) every epoch. Its position is a checkpoint's
    ``data`` entry, as the other streams'."""

    def __init__(self, prompts: list[Prompt], cfg: GrpoConfig, micro_batch: int,
                 grad_accum: int, seed: int, seq_len: int, pad_id: int, tok):
        self.prompts, self.cfg, self.tok = prompts, cfg, tok
        self.micro_batch, self.seed, self.seq_len, self.pad_id = micro_batch, seed, seq_len, pad_id
        self.G = cfg.group_size
        self.P = micro_batch * grad_accum // self.G
        self.together = cfg.prompts_together
        """Prompts whose groups decode in one batch (the plan's pick, at most the config's)."""
        if len(prompts) < self.P:
            raise UserError("train.micro_batch", f"x train.grad_accum / grpo.group_size is "
                            f"{self.P} prompts a step, but the data holds {len(prompts)}",
                            "lower train.micro_batch or train.grad_accum, or add prompts")
        self.steps_per_epoch = len(prompts) // self.P
        self.epoch, self.pos = 0, 0
        self.reward = reward_function(cfg, prompts)
        self.policy: Sampler | None = None
        self.last: RolloutStats | None = None

    def next_step(self) -> list[GrpoBatch]:
        import time
        if self.pos >= self.steps_per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.prompts))
        chosen = [self.prompts[i] for i in order[self.pos * self.P:(self.pos + 1) * self.P]]
        t0 = time.perf_counter()
        replies, scores = [], []
        seeds = [[int(np.random.default_rng([self.seed, self.epoch, self.pos, q, g])
                      .integers(1 << 62)) for g in range(self.G)] for q in range(self.P)]
        self.policy.start()
        k = self.together
        for q0 in range(0, self.P, k):  # k prompts' groups decoded at once
            part = chosen[q0:q0 + k]
            for p, group in zip(part, self.policy.groups([p.ids for p in part],
                                                         seeds[q0:q0 + k])):
                for ids, stopped in group:
                    replies.append(ids)
                    text = self.tok.decode(ids[:-1] if stopped else ids)
                    scores.append(self.reward(p, text))
        self.policy.done()
        self.pos += 1
        rewards = torch.tensor(scores, dtype=torch.float64).view(self.P, self.G)
        adv = advantages(rewards).view(-1)
        self.last = RolloutStats(float(rewards.mean()), float(rewards.std(unbiased=False)),
                                 float(np.mean([len(r) for r in replies])),
                                 time.perf_counter() - t0)
        m, rows = self.micro_batch, [chosen[r // self.G] for r in range(len(replies))]
        return [replies_batch(rows[i:i + m], replies[i:i + m], adv[i:i + m], self.seq_len,
                              self.pad_id, self.P, self.G) for i in range(0, len(replies), m)]

    def state_dict(self) -> dict:
        return {"kind": "grpo", "prompts": len(self.prompts), "per_step": self.P,
                "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        same_position(self.state_dict(), state, ("kind", "prompts", "per_step", "seed"))
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
