"""Training checkpoints: crash-safe writing, verification, and choosing what to resume from.

Layout of ``<run dir>/checkpoints/``::

    step-N/                  a complete checkpoint: N optimizer steps done
        embed.safetensors    exact host state of each window item: w (+ rem), m, v
        layer0.safetensors ...
        head.safetensors
        trainer.json         step, schedule position, data position, RNG states, run config
        manifest.json        size and sha256 of every file above; written last
    .step-N.tmp/             a checkpoint being written: never read
    .step-N.old/             a checkpoint being deleted: never read
    step-N.corrupt/          a checkpoint that failed verification, set aside for inspection

Writing (:func:`write_checkpoint`): every file goes into ``.step-N.tmp``, hashed on its way out
and fsynced; then the manifest, then the folder is fsynced and renamed to ``step-N``, and the
parent fsynced. The rename is the commit: a crash at any moment leaves either no ``step-N`` or a
complete one, and the previous checkpoints as they were. Older checkpoints are deleted only
after the new one is in place, each renamed out of the way first, so a half-deleted folder never
carries a checkpoint's name; the Trainer also calls :func:`rotate` when a run resumes, which
finishes a rotation that a kill interrupted.

Reading (:func:`load_newest`): ``step-N`` folders newest first; one is taken when its manifest
is present, its files have the listed sizes, and every byte hashes to the listed sha256 as it
loads (one read of the state, straight into the host buffers). A damaged one is skipped for the
next older one; once one loads, the damaged ones are reported and set aside as
``step-N.corrupt`` (when none loads, nothing is moved).

The item files are ordinary safetensors files (``safetensors.torch.load_file`` reads them); they
are written and read here tensor by tensor in 64 MiB chunks so that hashing costs no second pass
and no extra copy of the state.

Test hooks: the environment variable ``SLIDEFORMER_TEST_SLOW_IO`` (seconds) makes the writer
sleep that long before each file and before the commit, so fault-injection tests can kill the
process in the middle of a checkpoint (tests/engine/train/test_reliability.py); the points
``checkpoint.*`` of :mod:`slideformer.engine.testhooks` stop it at one precise moment
(tests/engine/train/test_kill_matrix.py).
"""
from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
import re
import shutil
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from slideformer.engine.errors import UserError
from slideformer.engine.models.weights import fsync_path
from slideformer.engine.testhooks import pause_at

MANIFEST, META = "manifest.json", "trainer.json"
FORMAT = 1
CHUNK = 64 << 20
_NAME = re.compile(r"step-(\d+)")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int16: "I16", torch.int8: "I8"}  # I8: 8-bit moments (runtime.moments8)
_MAX_HEADER = 100 << 20


class CorruptCheckpoint(Exception):
    """A checkpoint folder that does not verify (truncated, altered, or never completed)."""


# ---- writing ------------------------------------------------------------------------------------
def write_checkpoint(root: Path, step: int, items: dict[str, dict[str, torch.Tensor]],
                     meta: dict, keep: int, protect: int | None = None) -> Path:
    """Write ``root/step-<step>`` atomically and keep the newest ``keep`` checkpoints (and the
    one of step ``protect``, when given: the best one of output.keep_best).

    Args:
        items: per window item, the tensors to store (``HostItem.state_tensors()``).
        meta: JSON-serialisable trainer state (stored as trainer.json).
        keep: how many complete checkpoints to keep, this one included.

    Raises:
        OSError: the write failed (e.g. ENOSPC); the temporary folder is removed and every
            existing checkpoint is left as it was.
    """
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    tmp.mkdir()
    try:
        files = {}
        for name, tensors in items.items():
            files[f"{name}.safetensors"] = _write_safetensors(tmp / f"{name}.safetensors", tensors)
        files[META] = _write_bytes(tmp / META, json.dumps(meta).encode())
        _write_bytes(tmp / MANIFEST, json.dumps({"format": FORMAT, "step": step,
                                                 "files": files}, indent=1).encode())
        fsync_path(tmp)
        _slow_io("checkpoint.commit")
        if final.exists():  # a damaged or superseded checkpoint of the same step
            _set_aside(final, root / f".step-{step}.old")
        os.replace(tmp, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rotate(root, keep, protect)
    return final


def rotate(root: Path, keep: int, protect: int | None = None) -> None:
    """Keep the newest ``keep`` checkpoints (and the one of step ``protect``); delete the rest
    and every leftover of an earlier process (a kill during a rotation leaves either)."""
    for old in checkpoints(root)[keep:]:
        if old.name != f"step-{protect}":
            pause_at("checkpoint.rotate")
            _set_aside(old, root / f".{old.name}.old")
    _remove_leftovers(root)


def checkpoint_bytes(items: dict[str, dict[str, torch.Tensor]]) -> int:
    """Bytes a checkpoint of these tensors takes on disk (headers aside)."""
    return sum(t.numel() * t.element_size() for ts in items.values() for t in ts.values())


def _slow_io(point: str) -> None:
    """The test hooks of the module docstring."""
    delay = os.environ.get("SLIDEFORMER_TEST_SLOW_IO")
    if delay:
        time.sleep(float(delay))
    pause_at(point)


class _Sha256:
    """sha256 computed on a helper thread, in order, while the caller reads or writes the next
    chunk (hashlib and file I/O both release the GIL), so a checkpoint costs max(I/O, hashing)
    rather than the sum: one core hashes about 1.7 GB/s (SHA extensions), about what the
    reference machine's disk writes (1.5 GB/s)."""

    _pool: ThreadPoolExecutor | None = None

    def __init__(self):
        if _Sha256._pool is None:
            _Sha256._pool = ThreadPoolExecutor(1, "checkpoint-sha256")
        self._sha = hashlib.sha256()
        self._last: Future | None = None

    def update(self, data) -> None:
        """Hash ``data`` next; it must not change until :meth:`hexdigest`."""
        self._last = self._pool.submit(self._sha.update, data)

    def hexdigest(self) -> str:
        if self._last is not None:
            self._last.result()
        return self._sha.hexdigest()


class _HashingFile:
    """A new file, written and hashed in chunks: ``with _HashingFile(p) as f: f.write(..)``,
    then ``f.entry()`` once the block ended (the file is then flushed, fsynced and closed)."""

    def __init__(self, path: Path):
        _slow_io("checkpoint.file")
        self.f = open(path, "xb")
        self.sha = _Sha256()
        self.size = 0

    def __enter__(self) -> "_HashingFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.f.flush()
                os.fsync(self.f.fileno())
        finally:
            try:
                self.f.close()
            except OSError:
                if exc_type is None:
                    raise

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        for s in range(0, len(mv), CHUNK):
            part = mv[s:s + CHUNK]
            self.sha.update(part)
            self.f.write(part)
        self.size += len(mv)

    def entry(self) -> dict:
        """The file's manifest entry."""
        return {"bytes": self.size, "sha256": self.sha.hexdigest()}


def _write_bytes(path: Path, data: bytes) -> dict:
    with _HashingFile(path) as out:
        out.write(data)
    return out.entry()


def _raw(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write a safetensors file tensor by tensor; returns its manifest entry."""
    header, off = {}, 0
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the reference writer aligns the data to 8 bytes
    with _HashingFile(path) as out:
        out.write(struct.pack("<Q", len(head)) + head)
        for t in tensors.values():
            out.write(_raw(t))
            pause_at("checkpoint.tensor")
    return out.entry()


def _set_aside(folder: Path, new: Path) -> None:
    """Rename ``folder`` out of the checkpoint namespace (atomic), then delete it."""
    shutil.rmtree(new, ignore_errors=True)
    os.replace(folder, new)
    if new.name.endswith(".old"):
        pause_at("checkpoint.delete")
        shutil.rmtree(new, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Temporary and half-deleted folders of an earlier process (never read)."""
    for p in root.glob(".step-*"):
        if p.name.endswith((".tmp", ".old")):
            shutil.rmtree(p, ignore_errors=True)


# ---- finding and reading ------------------------------------------------------------------------
def checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders (``step-N``), newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def _manifest(folder: Path) -> dict:
    """The manifest of a folder, after checking that every listed file has its size."""
    try:
        man = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = man["files"]
        if man.get("format") != FORMAT or not isinstance(files, dict) or META not in files:
            raise ValueError("unknown manifest format")
    except FileNotFoundError:
        raise CorruptCheckpoint("it has no manifest (it was never completed)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"its manifest is unreadable ({e})") from None
    for name, entry in files.items():
        try:
            size = (folder / name).stat().st_size
        except OSError:
            raise CorruptCheckpoint(f"{name} is missing") from None
        if size != entry["bytes"]:
            raise CorruptCheckpoint(f"{name} has {size} bytes, the manifest says {entry['bytes']}")
    return man


def read_meta(folder: Path) -> dict:
    """The verified trainer.json of a checkpoint."""
    man = _manifest(folder)
    try:
        data = (folder / META).read_bytes()
    except OSError as e:
        raise CorruptCheckpoint(f"{META} cannot be read ({e.strerror or e})") from None
    if hashlib.sha256(data).hexdigest() != man["files"][META]["sha256"]:
        raise CorruptCheckpoint(f"{META} does not match its sha256")
    return json.loads(data)


def newest_meta(root: Path) -> dict | None:
    """The trainer state of the newest checkpoint whose trainer.json verifies (None: none)."""
    for folder in checkpoints(root):
        try:
            return read_meta(folder)
        except CorruptCheckpoint:
            continue
    return None


def read_state(folder: Path, items: dict[str, dict[str, torch.Tensor]]) -> None:
    """Read every item's tensors into ``items``' buffers, verifying each file's sha256.

    Raises:
        CorruptCheckpoint: a file is missing, truncated or altered (the buffers then hold
            partial data: load another checkpoint over them).
        UserError: the files are intact but were written for another model or precision.
    """
    man = _manifest(folder)
    for name, tensors in items.items():
        fname = f"{name}.safetensors"
        if fname not in man["files"]:
            raise UserError(folder, f"has no state for '{name}'",
                            "resume with the model and settings of the checkpointed run")
        try:
            _read_safetensors(folder / fname, tensors, man["files"][fname]["sha256"])
        except OSError as e:
            raise CorruptCheckpoint(f"{fname} cannot be read ({e.strerror or e})") from None


def _read_safetensors(path: Path, dst: dict[str, torch.Tensor], sha256: str) -> None:
    sha = _Sha256()
    with open(path, "rb") as f:

        def read_into(buf) -> None:
            mv = memoryview(buf).cast("B")
            for s in range(0, len(mv), CHUNK):
                part = mv[s:s + CHUNK]
                if f.readinto(part) != len(part):
                    raise CorruptCheckpoint(f"{path.name} is truncated")
                sha.update(part)

        def rest_matches() -> bool:
            while chunk := f.read(CHUNK):
                sha.update(chunk)
            return sha.hexdigest() == sha256

        size = bytearray(8)
        read_into(size)
        (n,) = struct.unpack("<Q", size)
        if n > _MAX_HEADER:
            raise CorruptCheckpoint(f"{path.name} has a damaged header")
        head = bytearray(n)
        read_into(head)
        try:
            header = json.loads(bytes(head))
            header.pop("__metadata__", None)
            layout = {k: (v["dtype"], v["shape"]) for k, v in header.items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            raise CorruptCheckpoint(f"{path.name} has a damaged header") from None
        want = {k: (_ST_DTYPES[t.dtype], list(t.shape)) for k, t in dst.items()}
        if layout != want:
            if not rest_matches():
                raise CorruptCheckpoint(f"{path.name} does not match its sha256")
            raise UserError(path, "holds tensors of another model or precision than this run",
                            "resume with the model and settings of the checkpointed run")
        order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        for key in order:
            read_into(_raw(dst[key]))
        if not rest_matches():
            raise CorruptCheckpoint(f"{path.name} does not match its sha256")


def load_newest(root: Path, items: dict[str, dict[str, torch.Tensor]],
                accept: Callable[[dict], None], warn: Callable[[str], None]) -> tuple[Path, dict]:
    """Load the newest checkpoint that verifies; returns its folder and trainer state.

    Args:
        items: the buffers to fill (``HostItem.state_tensors()`` per item).
        accept: called with the trainer state before the tensors are read; raises UserError
            when the checkpoint cannot continue this run (e.g. other batch settings).
        warn: told about each damaged checkpoint that is set aside.
    """
    found = checkpoints(root)
    if not found:
        raise UserError(root, "holds no complete checkpoint", "start a new run without --resume")
    damaged = []
    for folder in found:
        try:
            meta = read_meta(folder)
            accept(meta)
            read_state(folder, items)
        except CorruptCheckpoint as e:
            damaged.append((folder, str(e)))
            continue
        for bad, why in damaged:  # all newer than the one loaded: out of the run's way
            _set_aside(bad, bad.with_name(bad.name + ".corrupt"))
            warn(f"checkpoint {bad.name} is damaged ({why}): set aside as {bad.name}.corrupt; "
                 f"resuming from {folder.name}")
        return folder, meta
    raise UserError(root, "holds no intact checkpoint (" + "; ".join(
        f"{bad.name}: {why}" for bad, why in damaged) + ")",
        "start a new run without --resume, or into another output.run_dir")


def write_error(e: OSError, folder: Path, need: int = 0) -> str:
    """Words for a failed write into ``folder``: what happened, with the disk figures."""
    what = os.strerror(e.errno) if e.errno else str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = _human(shutil.disk_usage(folder).free)
            what += f" ({_human(need)} needed, {free} free)" if need else f" ({free} free)"
        except OSError:
            pass
    return what


def _human(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


# ---- random number generators -------------------------------------------------------------------
def rng_state() -> dict:
    """Every RNG state a run could draw from, JSON-serialisable (torch CPU and CUDA, Python)."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    version, state, gauss = random.getstate()
    return {"torch": _b64(torch.get_rng_state()),
            "cuda": cuda, "python": [version, list(state), gauss]}


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def set_rng_state(saved: dict) -> None:
    """Restore :func:`rng_state` (the CUDA part when this machine has as many GPUs)."""
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(saved["torch"]))
    cuda = saved.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([tensor(s) for s in cuda])
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
