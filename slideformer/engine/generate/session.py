"""A model ready to chat: weights placed, tokenizer and chat template loaded, stop tokens known.

``ChatModel(path)`` resolves the folder (:mod:`slideformer.engine.generate.source`), decides where the
weights live (resident when they fit the device's free memory with room to spare, else streamed
through the window: :mod:`slideformer.engine.generate.window`), and turns a conversation into a reply
streamed as text pieces (:meth:`ChatModel.reply`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import psutil
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.generate.decoder import Finished, generate
from slideformer.engine.generate.sampling import SamplingConfig
from slideformer.engine.generate.source import resolve_model
from slideformer.engine.generate.window import ResidentWeights, StreamedWeights
from slideformer.engine.models.tokenizer import TokenizerInfo, load_tokenizer
from slideformer.engine.runtime.backend import make_backend

MODES = ("auto", "resident", "streamed")
RESIDENT_SHARE = 0.8
"""Auto mode keeps a model resident when weights + the longest KV cache take at most this share
of the free device memory (the rest is for activations, the OS and the app)."""
CACHE_TOKENS = 4096
"""The KV cache length the auto mode budgets for."""
_END_MARK = "\u2063END\u2063"


@dataclass(frozen=True)
class TextPiece:
    """New reply text, as it streams."""

    text: str


class TextStream:
    """Token ids in, the text they add out; a character split across tokens waits for its end."""

    def __init__(self, tok: TokenizerInfo):
        self.tok, self.ids, self.shown = tok, [], ""

    def feed(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return ""
        new = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        return new


def end_of_turn_ids(tok: TokenizerInfo) -> set[int]:
    """The special token the chat template puts after an assistant message (<|im_end|>,
    <|eot_id|>, </s>...), found by rendering one; empty without a template."""
    if tok.chat_template is None:
        return set()
    try:
        text = tok.render_chat([{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": _END_MARK}])
    except UserError:
        return set()
    after = text.partition(_END_MARK)[2]
    ids = tok.encode(after) if after else []
    specials = tok.tok.get_added_tokens_decoder()
    return {ids[0]} if ids and ids[0] in specials and specials[ids[0]].special else set()


def _ids(value) -> set[int]:
    if isinstance(value, int):
        return {value}
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


class ChatModel:
    """One model, loaded for generation.

    Args:
        path: a model folder or a training checkpoint folder.
        mode: auto, resident or streamed (see the module docstring).
        device: cpu, cuda or auto.
        slots: device slots of the streamed window.
    """

    def __init__(self, path: Path | str, mode: str = "auto", device: str = "auto", slots: int = 2):
        if mode not in MODES:
            raise UserError("--mode", f"is '{mode}'", f"use one of {', '.join(MODES)}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError("--device", "is 'cuda' but no CUDA GPU is available",
                            "use --device cpu, or install a CUDA build of torch")
        self.source = resolve_model(path)
        self.spec = self.source.spec
        self.tok = load_tokenizer(self.source.tokenizer_dir)
        self.backend = make_backend(device)
        self.device = self.backend.device
        self.dtype = torch.bfloat16 if self.backend.is_cuda else torch.float32
        self.mode = self._choose_mode() if mode == "auto" else mode
        reader = self.source.open_weights()
        if self.mode == "resident":
            self.weights = ResidentWeights(self.spec, reader, self.dtype, self.backend)
            reader.close()
        else:
            self.weights = StreamedWeights(self.spec, reader, self.dtype, self.backend, slots)
        self.stop_ids = frozenset(self._stop_ids())

    def _choose_mode(self) -> str:
        size = torch.empty((), dtype=self.dtype).element_size()
        need = self.spec.num_params * size + self._cache_bytes(size)
        free = (torch.cuda.mem_get_info(self.device)[0] if self.backend.is_cuda
                else psutil.virtual_memory().available)
        return "resident" if need <= RESIDENT_SHARE * free else "streamed"

    def _cache_bytes(self, size: int) -> int:
        return self.spec.kv_values_per_token * CACHE_TOKENS * size

    def _stop_ids(self) -> set[int]:
        """eos of config.json, generation_config.json and the tokenizer, and the template's
        end-of-turn token."""
        ids = _ids(self.spec.raw_config.get("eos_token_id"))
        ids |= _ids(self.source.generation_config().get("eos_token_id"))
        if self.tok.eos_id is not None:
            ids.add(self.tok.eos_id)
        return ids | end_of_turn_ids(self.tok)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation rendered by the model's chat template, ready for the reply."""
        ids = self.tok.encode(self.tok.render_chat(messages, add_generation_prompt=True))
        if len(ids) >= self.spec.max_position_embeddings:
            raise UserError("conversation", f"is {len(ids):,} tokens, the model reads at most "
                                            f"{self.spec.max_position_embeddings:,}",
                            "start a new conversation or shorten the message")
        return ids

    def tokens(self, prompt: list[int], cfg: SamplingConfig,
               should_stop: Callable[[], bool] = lambda: False) -> Iterator[int | Finished]:
        """New token ids for ``prompt``, then a :class:`Finished` (see decoder.generate)."""
        return generate(self.spec, self.weights, prompt, cfg, self.stop_ids, self.device,
                        self.dtype, should_stop)

    def reply(self, messages: list[dict], cfg: SamplingConfig,
              should_stop: Callable[[], bool] = lambda: False) -> Iterator[TextPiece | Finished]:
        """The assistant's reply to ``messages`` as text pieces, then a :class:`Finished`."""
        stream = TextStream(self.tok)
        for out in self.tokens(self.prompt_ids(messages), cfg, should_stop):
            if isinstance(out, Finished):
                yield out
            else:
                text = stream.feed(out)
                if text:
                    yield TextPiece(text)

    def describe(self) -> dict:
        """Plain facts for the front ends."""
        return {"model": str(self.source.path), "family": self.spec.model_type,
                "layers": self.spec.num_layers, "params": self.spec.num_params,
                "mode": self.mode, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "chat_template": self.tok.chat_template is not None,
                "max_tokens": self.spec.max_position_embeddings}

    def close(self) -> None:
        self.weights.close()
