"""Tokenizing documents in batches: token ids plus a per-token loss-target mask.

``mask[i] == 1`` means token i is a training target (its logits come from position i - 1), so
the first token of a document is never one. Conventions:

- Text is encoded with the model's own special-token convention (``add_special_tokens=True``:
  Llama adds BOS, Qwen adds nothing) and every token is trained.
- A conversation is rendered by its chat template, which writes its own special tokens, so it is
  encoded with ``add_special_tokens=False`` (as ``apply_chat_template`` does). With
  ``train_on="assistant"`` only tokens that overlap a trained reply's span are trained (not
  replies with ``weight: 0``, nor earlier ones with ``mask_history``).
- EOS is appended where the document would otherwise not end with one: text not ending in EOS,
  or a conversation with no EOS after the start of its last assistant reply (a template whose
  end-of-turn marker is the EOS token, such as ChatML with ``<|im_end|>``, needs none). When the
  conversation ends with a trained reply, the EOS and the template text between them are
  trained.

Both paths use the tokenizers batch API, whose Rust encoder runs on all cores.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slideformer.engine.data.chat import ChatRenderer, token_ranges
from slideformer.engine.data.conversation import Conversation
from slideformer.engine.models.tokenizer import TokenizerInfo


@dataclass
class EncodedBatch:
    """Token ids and target mask of several documents, concatenated."""

    ids: np.ndarray
    """(N,) int32."""
    mask: np.ndarray
    """(N,) uint8, 1 where the token is a training target."""
    lengths: np.ndarray
    """(D,) int64 tokens per document."""
    texts: list[str] = field(default_factory=list)
    """The encoded strings (rendered conversations), only when asked for (previews)."""
    offsets: list[list[tuple[int, int]]] = field(default_factory=list)
    """Character span of each token in its text; (0, 0) for added tokens (BOS, EOS)."""


def encode_texts(tok: TokenizerInfo, texts: list[str], detail: bool = False) -> EncodedBatch:
    """Tokenize plain-text documents; every token after the first is trained."""
    # encode_batch_fast (tokenizers >= 0.20) skips the offsets, twice as fast here
    fast = getattr(tok.tok, "encode_batch_fast", tok.tok.encode_batch)
    encs = (tok.tok.encode_batch if detail else fast)(texts, add_special_tokens=True)
    ids = [np.asarray(e.ids, dtype=np.int32) for e in encs]
    eos_id = tok.eos_id
    ends_eos = [len(a) > 0 and a[-1] == eos_id for a in ids]
    masks = [np.ones(len(a), dtype=np.uint8) for a in ids]
    out = _assemble(tok, ids, masks, [not e for e in ends_eos], [True] * len(ids))
    if detail:
        out.texts = list(texts)
        out.offsets = [list(e.offsets) for e in encs]
    return out


def encode_chats(tok: TokenizerInfo, renderer: ChatRenderer, convs: list[Conversation],
                 train_on: str, detail: bool = False) -> EncodedBatch:
    """Render and tokenize conversations; see the module docstring for the mask."""
    texts = [renderer.render(c) for c in convs]
    spans = [renderer.spans(c, t) if train_on == "assistant" else None
             for c, t in zip(convs, texts)]
    encs = tok.tok.encode_batch(texts, add_special_tokens=False)
    eos_id = tok.eos_id
    ids, masks, need_eos, eos_trained = [], [], [], []
    for conv, enc, sp in zip(convs, encs, spans):
        a = np.asarray(enc.ids, dtype=np.int32)
        trained = np.ones(len(a), np.uint8) if sp is None else np.zeros(len(a), np.uint8)
        ranges = token_ranges(enc, sp) if sp else []
        for first, end in ranges:
            trained[first:end] = 1
        last_reply = ranges[-1][0] if ranges else 0
        add = eos_id is not None and not bool((a[last_reply:] == eos_id).any())
        ends_with_reply = sp is None or conv.trained[-1]
        if add and ends_with_reply and ranges:
            # The template's tail after the reply (e.g. "\n") now precedes the appended EOS:
            # train it too, or the model never learns the way to the EOS.
            trained[last_reply:] = 1
        ids.append(a)
        masks.append(trained)
        need_eos.append(add)
        eos_trained.append(ends_with_reply)
    out = _assemble(tok, ids, masks, need_eos, eos_trained)
    if detail:
        out.texts = texts
        out.offsets = [list(e.offsets) for e in encs]
    return out


def encode_documents(tok: TokenizerInfo, renderer: ChatRenderer, docs: list, train_on: str,
                     detail: bool = False) -> EncodedBatch:
    """Encode documents of one kind (all plain text, or all conversations)."""
    if docs and isinstance(docs[0], str):
        return encode_texts(tok, docs, detail)
    return encode_chats(tok, renderer, docs, train_on, detail)


def _assemble(tok: TokenizerInfo, ids: list[np.ndarray], masks: list[np.ndarray],
              need_eos: list[bool], eos_trained: list[bool]) -> EncodedBatch:
    """Concatenate documents, appending EOS where asked and clearing each first token's mask."""
    id_parts, mask_parts, lengths = [], [], []
    eos = None if tok.eos_id is None else np.array([tok.eos_id], np.int32)
    for a, m, add, tr in zip(ids, masks, need_eos, eos_trained):
        if len(m):
            m[0] = 0
        id_parts.append(a)
        mask_parts.append(m)
        n = len(a)
        if add and eos is not None:
            id_parts.append(eos)
            mask_parts.append(np.array([int(tr and n > 0)], np.uint8))
            n += 1
        lengths.append(n)
    if not id_parts:
        return EncodedBatch(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64))
    return EncodedBatch(np.concatenate(id_parts), np.concatenate(mask_parts),
                        np.asarray(lengths, dtype=np.int64))


def segments(tok: TokenizerInfo, batch: EncodedBatch, doc: int,
             limit: int | None = None) -> list[tuple[str, bool]]:
    """The text of one document (its first ``limit`` tokens) as (piece, trained) runs.

    Pieces are slices of the encoded text between token starts, so they join back into it
    exactly; tokens that are not in the text (an added BOS or EOS) show as their token string.
    Linear in the document's length (runs are joined once, not grown piece by piece).
    """
    start = int(batch.lengths[:doc].sum())
    n = int(batch.lengths[doc]) if limit is None else min(limit, int(batch.lengths[doc]))
    ids, mask = batch.ids[start:start + n], batch.mask[start:start + n]
    text, offsets = batch.texts[doc], batch.offsets[doc]
    # Several tokens can share one start (a character split into byte tokens): the first
    # of them carries the text up to the next distinct start.
    bounds = sorted({s for s, e in offsets if e > s}) + [len(text)]
    upto = dict(zip(bounds[:-1], bounds[1:]))
    runs: list[tuple[list[str], bool]] = []
    for i in range(n):
        s, e = offsets[i] if i < len(offsets) else (0, 0)
        if e > s:
            piece = text[s:upto.pop(s)] if s in upto else ""
        else:
            piece = tok.tok.id_to_token(int(ids[i])) or ""
        trained = bool(mask[i])
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(piece)
        elif piece:
            runs.append(([piece], trained))
    return [("".join(pieces), trained) for pieces, trained in runs]
