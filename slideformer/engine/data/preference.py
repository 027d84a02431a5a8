"""Preference pairs (``train.objective`` dpo, orpo, simpo): records in TRL's conventions,
tokenized into a chosen and a rejected sequence each, and the micro-batches of pairs.

Records (a ``data.train`` file of any format the SFT reader takes):

- ``{"prompt": str, "chosen": str, "rejected": str}``: plain strings, not templated. A sequence
  is BOS (when the tokenizer has one) + the prompt's tokens, then the reply's tokens (no special
  tokens) and EOS; the reply and its EOS are the response (counted, as the text format trains
  EOS).
- conversational: ``prompt`` a list of messages, ``chosen`` / ``rejected`` a list holding one
  assistant message; rendered with the model's chat template, the response is exactly the tokens
  SFT trains for that reply (slideformer.engine.data.encode, the prompt's own replies masked).
  Without ``prompt`` (TRL's implicit prompt), chosen and rejected are whole conversations whose
  shared leading messages are the prompt.

KTO records (``train.objective = "kto"``): ``{"prompt", "completion", "label"}`` with a boolean
label (true: desirable), the prompt and completion as above. Each is paired with the same prompt
followed by the completion of the next record in the file (the last: the first's), the
mismatched reply whose log-probability KTO's KL estimate needs; it takes the ``rejected`` slot.

A response's log-probability is the sum over its tokens; prompt tokens never count. A pair whose
prompt leaves no room for a reply within ``data.max_seq_len`` is refused; a longer reply is cut
at the limit (counted and reported). Micro-batches hold ``micro_batch`` pairs as 2 x micro_batch
rows, the chosen sequences first, each padded to ``data.max_seq_len``: the shape the plan and the
executor's buffers are made for (labels shifted, -100 where nothing counts, as
slideformer.engine.data.dataset's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TYPE_CHECKING

import numpy as np

from slideformer.engine.config import DataConfig
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.conversation import Conversation
from slideformer.engine.data.dataset import MicroBatch
from slideformer.engine.data.encode import encode_chats
from slideformer.engine.data.records import Record, RecordReader, source_files
from slideformer.engine.data.stream import same_position
from slideformer.engine.errors import UserError
from slideformer.engine.events import Log
from slideformer.engine.kernels import IGNORE
from slideformer.engine.models.tokenizer import TokenizerInfo

if TYPE_CHECKING:
    import torch

_FIX = 'write each record as {"prompt": ..., "chosen": ..., "rejected": ...} (TRL\'s format)'


@dataclass(frozen=True)
class Sequence:
    ids: np.ndarray
    """(n,) int32 tokens."""
    mask: np.ndarray
    """(n,) uint8: 1 where the token is part of the response (a target)."""


@dataclass(frozen=True)
class Pair:
    chosen: Sequence
    rejected: Sequence
    where: str
    """The record it came from ("file:line")."""
    desirable: bool | None = None
    """KTO: the record's label (chosen is its reply, rejected the mismatched one)."""


@dataclass(frozen=True)
class PairSet:
    pairs: list[Pair]
    truncated: int
    """Pairs with a reply cut at data.max_seq_len."""
    template: str
    """The chat template used ("" for plain-string pairs only)."""


# ---- records ------------------------------------------------------------------------------------
def read_pairs(cfg: DataConfig, tok: TokenizerInfo, emit: Callable = lambda ev: None,
               kto: bool = False) -> PairSet:
    """Every pair (``kto``: labelled reply) of ``cfg.train``, checked and tokenized (see the
    module docstring)."""
    files = source_files(cfg.train)
    renderer = ChatRenderer(tok, cfg.chat_template, cfg.enable_thinking)
    records = [(rec, *(_kto_fields(rec) if kto else _fields(rec)))
               for rec in RecordReader(files, cfg.max_samples)]
    pairs, cut, chats = [], 0, 0
    for i, (rec, prompt, first, second) in enumerate(records):
        if kto:  # (reply, label) -> (reply, the next record's reply), the label kept
            first, label = first
            second = records[(i + 1) % len(records)][2][0]
        conversational = isinstance(first, list)
        if isinstance(second, list) != conversational:
            raise UserError(rec.where, "is conversational and its neighbour is not (or the "
                            "other way round)", "write every record of the file the same way")
        chats += conversational
        seqs = [(_chat if conversational else _plain)(tok, renderer, rec, prompt, reply)
                for reply in (first, second)]
        fitted = [_fit(s, cfg.max_seq_len, rec) for s in seqs]
        cut += any(len(s.ids) > cfg.max_seq_len for s in seqs)
        pairs.append(Pair(fitted[0], fitted[1], rec.where, label if kto else None))
    what = "labelled replies" if kto else "preference pairs"
    if cut:
        emit(Log("warning", f"{cfg.train}: {cut} of {len(pairs)} {what} have a reply longer than "
                            f"data.max_seq_len = {cfg.max_seq_len} tokens, cut at the limit"))
    if kto and len({p.desirable for p in pairs}) < 2:
        emit(Log("warning", f"{cfg.train}: every reply is labelled "
                            f"{'desirable' if pairs[0].desirable else 'undesirable'}; KTO "
                            "learns from both kinds"))
    emit(Log("info", f"{cfg.train}: {len(pairs):,} {what}"))
    return PairSet(pairs, cut, renderer.where if chats else "")


def _kto_fields(rec: Record) -> tuple:
    """(prompt, (completion, label), None) of a KTO record."""
    v = rec.value
    fix = 'write each record as {"prompt": ..., "completion": ..., "label": true or false}'
    if not isinstance(v, dict):
        raise UserError(rec.where, "is not a KTO record (a JSON object)", fix)
    if "chosen" in v or "rejected" in v:
        raise UserError(rec.where, "holds a pair ('chosen'/'rejected'), not a labelled reply",
                        "train pairs with train.objective = \"dpo\" (or orpo, simpo)")
    if not isinstance(v.get("label"), bool):
        raise UserError(rec.where, f"has the label {v.get('label')!r}, not true or false", fix)
    completion, prompt = v.get("completion"), v.get("prompt")
    if completion in (None, "", []):
        raise UserError(rec.where, "has no 'completion'", fix)
    if isinstance(completion, str):
        if not isinstance(prompt, str):
            raise UserError(rec.where, "has a string completion but its 'prompt' is "
                            f"{'missing' if prompt is None else type(prompt).__name__}",
                            "give the prompt as a string too")
    else:
        for key, msgs in (("prompt", prompt), ("completion", completion)):
            _check_messages(rec, key, msgs)
    return prompt, (completion, v["label"]), None


def _fields(rec: Record) -> tuple:
    """(prompt, chosen reply, rejected reply) of a record: strings, or message lists."""
    v = rec.value
    if not isinstance(v, dict):
        raise UserError(rec.where, "is not a preference record (a JSON object)", _FIX)
    if "label" in v or "completion" in v:
        raise UserError(rec.where, "holds a KTO record ('completion' and 'label'), not a pair",
                        "train labelled replies with train.objective = \"kto\"")
    for key in ("chosen", "rejected"):
        if v.get(key) in (None, "", []):
            raise UserError(rec.where, f"has no '{key}' reply", _FIX)
    chosen, rejected, prompt = v["chosen"], v["rejected"], v.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise UserError(rec.where, "has string replies but its 'prompt' is "
                            f"{'missing' if prompt is None else type(prompt).__name__}",
                            "give the prompt as a string too")
        if chosen == rejected:
            raise UserError(rec.where, "has the same text as 'chosen' and 'rejected'",
                            "remove the record: a pair must prefer one reply to another")
        return prompt, chosen, rejected
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UserError(rec.where, "mixes a string reply with a message list",
                        "give 'chosen' and 'rejected' both as strings or both as message lists")
    if prompt is None:  # TRL's implicit prompt: the messages both conversations start with
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    for key, msgs in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        _check_messages(rec, key, msgs)
    if chosen == rejected:
        raise UserError(rec.where, "has the same reply as 'chosen' and 'rejected'",
                        "remove the record: a pair must prefer one reply to another")
    return prompt, chosen, rejected


def _check_messages(rec: Record, key: str, msgs) -> None:
    if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in msgs):
        raise UserError(rec.where, f"'{key}' is not a list of {{\"role\", \"content\"}} messages",
                        _FIX)
    if key == "prompt" and not msgs:
        raise UserError(rec.where, "has no prompt (chosen and rejected share no first message)",
                        "add a 'prompt' list of messages")
    if key != "prompt" and (len(msgs) != 1 or msgs[0]["role"] != "assistant"):
        raise UserError(rec.where, f"'{key}' must hold one assistant message, it holds "
                        f"{[m['role'] for m in msgs]}", "put earlier turns into 'prompt'")


# ---- tokenizing ---------------------------------------------------------------------------------
def _plain(tok: TokenizerInfo, renderer, rec: Record, prompt: str, reply: str) -> Sequence:
    head = tok.tok.encode(prompt, add_special_tokens=False).ids
    body = tok.tok.encode(reply, add_special_tokens=False).ids
    bos = [tok.bos_id] if tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    ids = np.asarray(bos + head + body + eos, np.int32)
    mask = np.zeros(len(ids), np.uint8)
    mask[len(bos) + len(head):] = 1
    return Sequence(ids, mask)


def _chat(tok: TokenizerInfo, renderer: ChatRenderer, rec: Record, prompt: list,
          reply: list) -> Sequence:
    conv = Conversation(list(prompt) + list(reply), (False,) * len(prompt) + (True,))
    try:
        enc = encode_chats(tok, renderer, [conv], "assistant")
    except UserError as e:
        raise UserError(rec.where, f"cannot be rendered with the chat template ({e})",
                        "fix the record's messages") from None
    if not enc.mask.any():
        raise UserError(rec.where, "has a reply the chat template does not render",
                        "check the record's roles against the model's chat template")
    return Sequence(enc.ids, enc.mask)


def _fit(s: Sequence, limit: int, rec: Record) -> Sequence:
    first = int(np.argmax(s.mask))  # where the response starts
    if first >= limit:
        raise UserError(rec.where, f"has a prompt of {first:,} tokens, which leaves no room for "
                        f"the reply within data.max_seq_len = {limit:,}",
                        "raise data.max_seq_len, or shorten or remove the record")
    return s if len(s.ids) <= limit else Sequence(s.ids[:limit], s.mask[:limit])


# ---- micro-batches ------------------------------------------------------------------------------
@dataclass
class PairBatch(MicroBatch):
    """A micro-batch of P pairs: rows 0..P-1 chosen, P..2P-1 rejected."""

    pairs: np.ndarray = None
    """(P,) indices of the pairs in the pair set."""
    desirable: "torch.Tensor | None" = None
    """KTO: (P,) bool labels of the replies (None for pairs)."""
    reference: "torch.Tensor | None" = None
    """(2P,) the reference model's response log-probabilities of the rows (None: not needed,
    or not known yet)."""

    @property
    def num_pairs(self) -> int:
        return len(self.pairs)


def pair_batch(pairs: list[Pair], index: np.ndarray, seq_len: int, pad_id: int,
               reference: np.ndarray | None = None) -> PairBatch:
    """The micro-batch of the pairs ``index`` (``reference``: (N, 2) of the whole set)."""
    import torch

    rows = [pairs[i].chosen for i in index] + [pairs[i].rejected for i in index]
    T = seq_len
    ids = np.full((len(rows), T), pad_id, np.int64)
    labels = np.full((len(rows), T), IGNORE, np.int64)
    for b, s in enumerate(rows):
        n = len(s.ids)
        ids[b, :n] = s.ids
        labels[b, :n - 1] = np.where(s.mask[1:] != 0, s.ids[1:], IGNORE)
    ref = None
    if reference is not None:
        ref = torch.from_numpy(np.concatenate([reference[index, 0], reference[index, 1]]))
    desirable = None
    if pairs[index[0]].desirable is not None:
        desirable = torch.tensor([pairs[i].desirable for i in index], dtype=torch.bool)
    return PairBatch(torch.from_numpy(ids), torch.from_numpy(labels), None,
                     pairs=np.asarray(index), reference=ref, desirable=desirable)


class PairStream:
    """Steps of ``micro_batch x grad_accum`` pairs, reshuffled (seeded) every epoch; its
    position is a checkpoint's ``data`` entry, as slideformer.engine.data's BatchStream's."""

    def __init__(self, pairs: list[Pair], micro_batch: int, grad_accum: int, seed: int,
                 seq_len: int, pad_id: int):
        self.pairs, self.micro_batch, self.grad_accum = pairs, micro_batch, grad_accum
        self.seed, self.seq_len, self.pad_id = seed, seq_len, pad_id
        self.per_step = micro_batch * grad_accum
        if len(pairs) < self.per_step:
            raise UserError("train.micro_batch", f"x train.grad_accum is {self.per_step} pairs "
                            f"per step, but the data holds {len(pairs)}",
                            "lower train.micro_batch or train.grad_accum, or add pairs")
        self.steps_per_epoch = len(pairs) // self.per_step
        self.epoch, self.pos = 0, 0
        self.reference: np.ndarray | None = None
        """(N, 2) reference log-probabilities, once computed (slideformer.engine.train)."""

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.pairs))

    def next_step(self) -> list[PairBatch]:
        if self.pos >= self.steps_per_epoch:
            self.epoch, self.pos = self.epoch + 1, 0
        take = self._order()[self.pos * self.per_step:(self.pos + 1) * self.per_step]
        self.pos += 1
        m = self.micro_batch
        return [pair_batch(self.pairs, take[i:i + m], self.seq_len, self.pad_id, self.reference)
                for i in range(0, len(take), m)]

    def batches(self, size: int):
        """Every pair once, in order, ``size`` pairs per micro-batch (the reference pass)."""
        for i in range(0, len(self.pairs), size):
            yield pair_batch(self.pairs, np.arange(i, min(i + size, len(self.pairs))),
                             self.seq_len, self.pad_id)

    def state_dict(self) -> dict:
        return {"kind": "pairs", "pairs": len(self.pairs), "per_step": self.per_step,
                "seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        same_position(self.state_dict(), state, ("kind", "pairs", "per_step", "seed"))
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


# ---- what a user sees before training -----------------------------------------------------------
@dataclass(frozen=True)
class PairReport:
    """``data inspect --pairs``: counts, and the first pairs with their responses marked."""
    pairs: int
    truncated: int
    template: str
    prompt_tokens: float
    """Mean prompt tokens of a sequence."""
    chosen_tokens: float
    """Mean response tokens (log-probability terms) of the chosen replies."""
    rejected_tokens: float
    """KTO: mean response tokens of the undesirable replies (``chosen_tokens``: desirable)."""
    samples: list
    """(where, "chosen" or "rejected" (KTO: "desirable" or "undesirable"), [(text piece, is
    response)]) of the first pairs (KTO: labelled replies)."""
    desirable: int | None = None
    """KTO: how many replies are labelled desirable (None: pairs)."""


def describe_pairs(cfg: DataConfig, tok: TokenizerInfo, n: int = 3, kto: bool = False
                   ) -> PairReport:
    """Counts and the first pairs (``kto``: labelled replies, as train.objective kto reads
    them: each record's own reply, its label, not the mismatched neighbour it is compared
    with) with their responses marked."""
    found = read_pairs(cfg, tok, kto=kto)
    ps = found.pairs

    def mean_reply(seqs) -> float:
        return float(np.mean([int(s.mask.sum()) for s in seqs])) if seqs else 0.0
    prompt = float(np.mean([int(np.argmax(p.chosen.mask)) for p in ps]))
    if kto:
        good = [p.chosen for p in ps if p.desirable]
        bad = [p.chosen for p in ps if not p.desirable]
        samples = [(p.where, "desirable" if p.desirable else "undesirable",
                    _pieces(tok, p.chosen)) for p in ps[:n]]
        return PairReport(len(ps), found.truncated, found.template, prompt, mean_reply(good),
                          mean_reply(bad), samples, len(good))
    samples = [(p.where, side, _pieces(tok, s)) for p in ps[:n]
               for side, s in (("chosen", p.chosen), ("rejected", p.rejected))]
    return PairReport(len(ps), found.truncated, found.template, prompt,
                      mean_reply([p.chosen for p in ps]), mean_reply([p.rejected for p in ps]),
                      samples)


def _pieces(tok: TokenizerInfo, s: Sequence) -> list[tuple[str, bool]]:
    """Runs of the sequence's tokens decoded, each marked response or not."""
    out, start = [], 0
    for i in range(1, len(s.ids) + 1):
        if i == len(s.ids) or s.mask[i] != s.mask[start]:
            out.append((tok.tok.decode(s.ids[start:i].tolist(), skip_special_tokens=False),
                        bool(s.mask[start])))
            start = i
    return out
