"""Columnar files (CSV, Parquet, Arrow IPC) read with pyarrow, a batch of rows at a time.

pyarrow is imported on first use: plain JSONL and text data never pay for it.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterator

from slideformer.engine.errors import UserError

BATCH_ROWS = 4096


def batches(f: Path) -> Iterator[tuple[object, float]]:
    """(pyarrow RecordBatch, fraction of the file read after it) pairs."""
    try:
        import pyarrow as pa
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f, "needs pyarrow to be read", "pip install pyarrow, or convert the "
                        "file to .jsonl") from None
    suffix = f.suffix.lower()
    try:
        if suffix == ".csv":
            yield from _csv(f, pa, pacsv)
        elif suffix == ".parquet":
            pf = pq.ParquetFile(f)
            total = max(1, pf.metadata.num_rows)
            done = 0
            for batch in pf.iter_batches(batch_size=BATCH_ROWS):
                done += batch.num_rows
                yield batch, done / total
        else:
            yield from _arrow(f, pa)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise UserError(f, f"cannot be read as {suffix[1:]} ({e})",
                        f"check that the file is a valid {suffix[1:]} file") from None


def _csv(f: Path, pa, pacsv) -> Iterator[tuple[object, float]]:
    with open(f, newline="", encoding="utf-8-sig") as fh:
        names = next(csv.reader(fh), [])
    # Every column as text: a cell "007" or "1e3" is the user's text, not a number.
    reader = pacsv.open_csv(f, read_options=pacsv.ReadOptions(block_size=1 << 22),
                            convert_options=pacsv.ConvertOptions(
                                column_types={n: pa.string() for n in names}))
    size, done = max(1, f.stat().st_size), 0
    for batch in reader:
        done += batch.nbytes
        yield batch, min(1.0, done / size)


def _arrow(f: Path, pa) -> Iterator[tuple[object, float]]:
    """An Arrow IPC file, or an IPC stream (what ``datasets`` writes as .arrow)."""
    try:
        reader = pa.ipc.open_file(f)
        n = max(1, reader.num_record_batches)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i), (i + 1) / n
        return
    except pa.ArrowInvalid:
        pass
    with pa.ipc.open_stream(f) as stream:
        batches = list(stream)  # a stream has no index to tell the progress by
    for i, batch in enumerate(batches):
        yield batch, (i + 1) / max(1, len(batches))
