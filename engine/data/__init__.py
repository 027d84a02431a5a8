"""Datasets: formats, chat templating, loss masks, packing, the token cache and batch streams.

The trainer's interface::

    prepared = prepare_data(cfg.data, tok, cache_dir, emit)
    stream = BatchStream(prepared.train, micro_batch=B, grad_accum=A, seed=S)
    for micro in stream.next_step(): ...          # A MicroBatch objects
    for micro in iterate_eval(prepared.val, B): ...
"""
import importlib

# Imported on first use (PEP 562): the CLI registers ``data inspect`` from engine.data.commands
# without importing torch, which engine.data.dataset needs.
_SOURCES = {"IGNORE": "dataset", "MicroBatch": "dataset", "SequenceDataset": "dataset",
            "DataStats": "prepare", "PreparedData": "prepare", "prepare_data": "prepare",
            "Sample": "preview", "preview": "preview",
            "BatchStream": "stream", "iterate_eval": "stream"}

__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_SOURCES[name]}"), name)
