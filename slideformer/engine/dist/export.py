"""``slideformer export-distributed``: a run config as a self-contained FSDP2 training folder.

Past one host the engine does not grow its own runtime (DESIGN §9): it writes a folder that
trains the same run with PyTorch's FSDP2 under ``torchrun``::

    DIR/train_fsdp.py     the training script (torch, transformers, numpy; no SlideFormer)
    DIR/torchrun.sh       the launch command, one host or several
    DIR/settings.json     model folder, run folder, AdamW hyper-parameters, the lr of every step,
                          clipping, batch shape, export dtype and shard size
    DIR/config.toml       the run config (copied into the run folder, for the app)
    DIR/data/             the training rows from the token cache: input_ids, labels (shifted),
                          doc_ids (R, T) and order (steps, grad_accum, micro_batch): the rows of
                          every micro-batch of every step, drawn by the trainer's own BatchStream

The data and the learning rates are computed here with the engine's own code, so the script
needs no copy of the data pipeline or the schedule: it reads the rows each step names.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from slideformer.engine import config as config_mod
from slideformer.engine.config import RunConfig, parse_bytes
from slideformer.engine.errors import UserError
from slideformer.engine.validate import validate

SCRIPT = Path(__file__).with_name("fsdp_script.py")
"""The training script, copied verbatim as ``train_fsdp.py``."""
ROWS_AT_ONCE = 256
"""Rows assembled per write while the data is exported (bounded memory for any dataset)."""

TORCHRUN = """#!/bin/sh
# Train this folder's run with PyTorch FSDP2 (see train_fsdp.py's header).
# One host:      NPROC=<GPUs of this host> sh torchrun.sh
# Several hosts: on host R of M, with HOST0:PORT the first host's address:
#   NNODES=M NODE_RANK=R NPROC=<GPUs per host> RDZV_ENDPOINT=HOST0:PORT sh torchrun.sh
# Extra arguments go to the script (--model DIR, --run-dir DIR, --cpu-offload on|off|auto).
cd "$(dirname "$0")"
NPROC=${NPROC:-1}
if [ -z "$RDZV_ENDPOINT" ]; then
  exec torchrun --standalone --nproc-per-node="$NPROC" train_fsdp.py "$@"
fi
exec torchrun --nnodes="${NNODES:-1}" --node-rank="${NODE_RANK:-0}" --nproc-per-node="$NPROC" \\
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-slideformer}" \\
  train_fsdp.py "$@"
"""


class _RowIndex:
    """A dataset whose batches are their row numbers: BatchStream over it yields the order."""

    def __init__(self, rows: int):
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def batch(self, rows) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64)


def export_distributed(cfg: RunConfig, out: Path | str, emit: Callable | None = None) -> Path:
    """Write the FSDP2 training folder of ``cfg`` to ``out`` (which must not hold anything).

    Raises:
        UserError: a bad config, a method FSDP2 export does not cover, or ``out`` in use.
    """
    from slideformer.engine.data import BatchStream, prepare_data
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.tokenizer import check_vocab, load_tokenizer
    from slideformer.engine.train.schedule import lr_at, run_steps

    validate(cfg, "train")
    out = Path(out)
    _check_out(out)
    if cfg.train.method != "full":
        raise UserError("train.method", f"is {cfg.train.method!r}: the FSDP2 export trains every "
                        "weight", "export a full fine-tuning run (train.method = \"full\")")
    spec = load_spec(cfg.model.path)
    tok = load_tokenizer(cfg.model.path)
    check_vocab(tok, spec.vocab_size, Path(cfg.model.path) / "config.json")
    run_dir = Path(cfg.output.run_dir)
    prepared = prepare_data(cfg.data, tok, run_dir.parent / ".token-cache", emit)
    t = cfg.train
    order = BatchStream(_RowIndex(len(prepared.train)), t.micro_batch, t.grad_accum,
                        seed=cfg.data.seed)
    steps = run_steps(t, order.steps_per_epoch)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "data").mkdir(parents=True)
    _write_rows(prepared.train, tmp / "data")
    np.save(tmp / "data" / "order.npy", np.stack([np.stack(order.next_step())
                                                  for _ in range(steps)]))
    o = cfg.optim
    settings = {"model": str(Path(cfg.model.path).resolve()), "run_dir": str(run_dir.resolve()),
                "seed": t.seed, "beta1": o.beta1, "beta2": o.beta2, "eps": o.eps,
                "weight_decay": o.weight_decay, "max_grad_norm": o.max_grad_norm,
                "lrs": [lr_at(k, steps, o) for k in range(1, steps + 1)],
                "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
                "seq_len": cfg.data.max_seq_len, "steps": steps,
                "save_dtype": spec.torch_dtype if spec.torch_dtype in ("float32", "float16")
                else "bfloat16",
                "shard_bytes": parse_bytes(cfg.output.shard_size, "output.shard_size")}
    (tmp / "settings.json").write_text(json.dumps(settings, indent=1), encoding="utf-8")
    (tmp / "config.toml").write_text(config_mod.dumps(cfg), encoding="utf-8")
    shutil.copyfile(SCRIPT, tmp / "train_fsdp.py")
    (tmp / "torchrun.sh").write_text(TORCHRUN, encoding="utf-8")
    os.chmod(tmp / "torchrun.sh", 0o755)
    if out.exists():  # an empty folder: checked above
        out.rmdir()
    os.replace(tmp, out)
    return out


def _check_out(out: Path) -> None:
    """Nothing the user has is overwritten: ``out`` is new or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(out, "already exists and is not an empty folder",
                        "choose a new --out folder (nothing in it is overwritten)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(out.parent, f"cannot be created ({e.strerror})",
                        "choose an --out folder in a place you can write to") from None


def _write_rows(dataset, folder: Path) -> None:
    """input_ids, labels and doc_ids of every row, as .npy files the script memory-maps."""
    shape = (len(dataset), dataset.seq_len)
    arrays = {name: np.lib.format.open_memmap(folder / f"{name}.npy", "w+", np.int32, shape)
              for name in ("input_ids", "labels", "doc_ids")}
    for lo in range(0, shape[0], ROWS_AT_ONCE):
        hi = min(lo + ROWS_AT_ONCE, shape[0])
        mb = dataset.batch(range(lo, hi))
        arrays["input_ids"][lo:hi] = mb.input_ids.numpy()
        arrays["labels"][lo:hi] = mb.labels.numpy()
        # no doc_ids: one document a row (then causal attention is exact, padding comes last)
        arrays["doc_ids"][lo:hi] = 0 if mb.doc_ids is None else mb.doc_ids.numpy()
    for a in arrays.values():
        a.flush()
