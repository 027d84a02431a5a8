"""Where batches are encoded: a helper thread, or a pool of worker processes for large sources.

``start(docs) -> handle`` submits a batch, ``handle.wait()`` returns its :class:`EncodedBatch`
(re-raising a worker's :class:`UserError` as the same message).

Why two: the tokenizers batch encoder is Rust and runs on every core, so one helper thread
saturates a small machine while the reading thread parses the next batch. But each batch also
costs GIL-bound Python (JSON parsing ~225 MB/s, converting ids to arrays ~45 MB/s, measured on
the 2-core CI machine), about 35 MB/s in all, against ~4 MB/s per core for the tokenizer: past
about eight cores that single Python thread becomes the bound, so there each worker process
encodes whole batches single-threaded instead.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.encode import EncodedBatch, encode_documents
from slideformer.engine.errors import UserError
from slideformer.engine.models.tokenizer import TokenizerInfo

PROCESS_MIN_CORES = 8
PROCESS_MIN_BYTES = 64 << 20
"""Smaller sources finish in seconds; forking a pool would not pay for itself."""


def auto_processes(total_bytes: int) -> int:
    """Worker processes worth using for a source of ``total_bytes`` (0: the thread)."""
    cores = os.cpu_count() or 1
    if cores < PROCESS_MIN_CORES or total_bytes < PROCESS_MIN_BYTES:
        return 0
    return cores if "fork" in multiprocessing.get_all_start_methods() else 0


@dataclass(frozen=True)
class _Failure:
    """A UserError crossing the process boundary (its __init__ does not unpickle)."""

    where: str
    problem: str
    fix: str


class _Handle:
    """One batch in flight; ``wait()`` returns its encoding."""

    def __init__(self, result: Callable[[], object]):
        self._result = result

    def wait(self) -> EncodedBatch:
        out = self._result()
        if isinstance(out, _Failure):
            raise UserError(out.where, out.problem, out.fix)
        return out


_worker: dict = {}  # the encoding context of a worker process, set by _init_worker


def _init_worker(tok: TokenizerInfo, renderer: ChatRenderer, train_on: str) -> None:
    _worker.update(tok=tok, renderer=renderer, train_on=train_on)


def _encode_in_worker(docs: list) -> EncodedBatch | _Failure:
    try:
        return encode_documents(_worker["tok"], _worker["renderer"], docs, _worker["train_on"])
    except UserError as e:
        return _Failure(e.where, e.problem, e.fix)


class Encoder:
    """Encodes batches off the reading thread; ``depth`` batches may be in flight."""

    def __init__(self, tok: TokenizerInfo, renderer: ChatRenderer, train_on: str,
                 processes: int = 0):
        self.renderer = renderer
        self._tok, self._train_on = tok, train_on
        self._pool = self._threads = None
        if processes > 0:
            # Each worker encodes single-threaded (the pool is the parallelism); the variable
            # also stops tokenizers warning that the parent used its threads before the fork.
            with _env("TOKENIZERS_PARALLELISM", "false"):
                self._pool = multiprocessing.get_context("fork").Pool(
                    processes, initializer=_init_worker, initargs=(tok, renderer, train_on))
            self.depth = 2 * processes
        else:
            self._threads = ThreadPoolExecutor(max_workers=1)
            self.depth = 1

    def start(self, docs: list) -> _Handle:
        if self._pool is not None:
            return _Handle(self._pool.apply_async(_encode_in_worker, (docs,)).get)
        return _Handle(self._threads.submit(encode_documents, self._tok, self.renderer, docs,
                                            self._train_on).result)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
        else:
            self._threads.shutdown(wait=True)

    def __enter__(self) -> "Encoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
