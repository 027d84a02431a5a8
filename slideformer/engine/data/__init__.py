"""Datasets: formats, chat templating, loss masks, packing, the token cache and batch streams.

The trainer's interface::

    prepared = prepare_data(cfg.data, tok, cache_dir, emit)
    stream = BatchStream(prepared.train, micro_batch=B, grad_accum=A, seed=S)
    for micro in stream.next_step(): ...          # A MicroBatch objects
    for micro in iterate_eval(prepared.val, B): ...
"""
from slideformer.engine.data.dataset import IGNORE, MicroBatch, SequenceDataset
from slideformer.engine.data.prepare import DataStats, PreparedData, prepare_data
from slideformer.engine.data.preview import Preview, Sample, preview
from slideformer.engine.data.stream import BatchStream, iterate_eval

__all__ = ["BatchStream", "DataStats", "IGNORE", "MicroBatch", "PreparedData", "Preview", "Sample",
           "SequenceDataset", "iterate_eval", "prepare_data", "preview"]
