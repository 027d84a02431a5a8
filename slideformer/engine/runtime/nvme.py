"""The NVMe tier: the AdamW moments (and optionally the remainders) of chosen layers live on disk,
or, with a frozen base (train.method lora / qlora), the base weights of chosen layers.

Which layers (:func:`disk_layers`): only decoder layers, so every staging buffer has one layer's
size (the embedding and the head can be the largest items and stay in RAM). The planner
(slideformer.engine.plan.evaluate) picks n, the fewest layers that bring the host state within the RAM
budget; they are spread evenly over the depth (layers 1 and 3 of 4 for n = 2). In the update order
(embed, 0 .. L-1, head) a disk layer then follows RAM layers whose updates hide its read, and
the next forward, which waits for each layer's update in turn, meets the disk layers one at a
time rather than in one block at the end. A frozen layer's file holds its weights (``w``: the
compute dtype, or its NF4 bytes), written once while the model loads and only read after that
(slideformer.engine.runtime.lora: read ahead in the order the step loads the layers).

Files: one per item in the chosen folder, created at setup with its full size (posix_fallocate;
a sparse ftruncate where the filesystem cannot preallocate) and unlinked as soon as it is open.
The space belongs to the process while it runs and goes back to the disk when it exits, however
it exits, so a crashed run leaves nothing behind (``df`` counts the files, ``ls`` does not list
them). A file holds the item's disk fields one after the other (rem, m, v), each padded to 4096
bytes; the staging buffers have the same layout, so an item moves in whole aligned requests.

I/O: files are opened with O_DIRECT where the filesystem accepts it (checked at the first file:
an EINVAL at open or on a probe read falls back), so the moments do not also fill the page
cache; buffers are page-aligned anonymous mappings, offsets and lengths multiples of 4096. With
``direct=False``, or where O_DIRECT is refused, plain buffered I/O. An item moves in requests of
``IO_CHUNK`` bytes spread over ``threads`` I/O threads (queue depth = threads).

Residency of every disk item is owned by the tier (one lock)::

    ON_DISK --prefetch--> QUEUED --(a buffer is free)--> READING --> READY --acquire--> IN_USE
    IN_USE --release(write=True)--> WRITING --(written)--> READY
    IN_USE --release(write=False)--> READY
    READY --(its buffer taken for another item)--> ON_DISK

A READY buffer always equals the file, so it can be taken back at any time; one that no
prefetch asked for is taken first, then the least recently used. ``acquire`` of an item not yet
read reads it at once (taking back a READY buffer if the pool is full), so a prefetch that is
never followed by its acquire (a step cut short) costs a read but never blocks. The pool holds
at most ``buffers`` buffers; a thread holds fewer items than that at a time (the optimizer one,
the frozen base's reader those whose copies to the device are in flight).

Checkpoints see the moments through :meth:`DiskItem.mapped`: tensors over a shared mapping of
the item's file (no copy in RAM: the writer reads the file, the reader writes it). The item's
buffer is dropped first and the next read syncs the file, so the direct reads and the mapping
agree whichever came last.
"""
from __future__ import annotations

import enum
import errno
import mmap
import os
import secrets
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch

from slideformer.engine.errors import UserError
from slideformer.engine.runtime.shapes import ALIGN, BUFFERS, moment_numel, padded

GiB = 1 << 30
IO_CHUNK = 16 << 20
THREADS = 4


# ---- which layers, and their size ---------------------------------------------------------------
# ---- the tier ------------------------------------------------------------------------------------
class Where(enum.Enum):
    ON_DISK = "on_disk"
    QUEUED = "queued"
    READING = "reading"
    READY = "ready"
    IN_USE = "in_use"
    WRITING = "writing"


class DiskItem:
    """One item's file in the tier: which fields it holds, where, and the item's staging calls.

    The methods are the tier's, for this item (see :class:`NvmeTier`).
    """

    def __init__(self, tier: "NvmeTier", name: str, numel: int, fields: dict[str, torch.dtype]):
        self.tier, self.name, self.numel = tier, name, numel
        self.fields = tuple(fields)
        self.buffers = tier.n_buffers
        self.offsets: dict[str, tuple[int, torch.dtype, int]] = {}
        off = 0
        for key, dtype in fields.items():  # int8 fields: 8-bit moments, their blocks' bytes
            count = moment_numel(numel, dtype)
            self.offsets[key] = (off, dtype, count)
            off += padded(count * dtype.itemsize)
        self.nbytes = off
        self.fd = -1
        # residency, guarded by the tier's lock
        self.where = Where.ON_DISK
        self.buf: mmap.mmap | None = None
        self.wanted = False
        """A prefetch asked for it (its READY buffer is taken back last)."""
        self.used = 0
        """Release count of the tier when it was last released (least recently used goes first)."""
        self.tl = None
        """Timeline of the step that prefetched it (its read span goes there)."""
        self.synced = True
        """False after :meth:`mapped` until the next read synced the file."""
        self.waiting = 0
        """Threads in :meth:`NvmeTier.acquire` for it (its READY buffer is not taken back)."""

    def views(self, buf) -> dict[str, torch.Tensor]:
        return {k: torch.frombuffer(buf, dtype=dt, count=count, offset=off)
                for k, (off, dt, count) in self.offsets.items()}

    def prefetch(self, tl=None) -> None:
        self.tier.prefetch(self, tl)

    def acquire(self, tl=None) -> dict[str, torch.Tensor]:
        return self.tier.acquire(self, tl)

    def release(self, write: bool, tl=None) -> None:
        self.tier.release(self, write, tl)

    def flush(self) -> None:
        self.tier.flush(self)

    def mapped(self) -> dict[str, torch.Tensor]:
        return self.tier.mapped(self)

    @contextmanager
    def staged(self, write: bool) -> Iterator[dict[str, torch.Tensor]]:
        """The fields in a staging buffer for the block; written back after it if ``write``."""
        views = self.acquire()
        try:
            yield views
        finally:
            self.release(write)


class _Op:
    """One read or write of an item, as several requests on the I/O threads."""

    def __init__(self, item: DiskItem, write: bool, requests: int, tl):
        self.item, self.write, self.left, self.tl = item, write, requests, tl
        self.t0: float | None = None
        self.error: Exception | None = None


class NvmeTier:
    """Files, staging buffers and I/O threads of the NVMe tier.

    Args:
        folder: where the files go (budget.nvme_dir).
        items: names of the items whose fields live on disk (e.g. ``layer1``).
        remainders: also keep the 16-bit weight remainders on disk (bf16 compute).
        size_limit: bytes the files may take (budget.nvme_size); 0: the free space.
        buffers: staging buffers (>= 1).
        direct: O_DIRECT where the filesystem accepts it; False: buffered I/O.
        pin: called with each staging buffer once it is mapped (a backend's ``pin_mapping``:
            buffers copied to the GPU, the frozen base's, must be page-locked for the copies to
            run asynchronously); None: left pageable.
    """

    def __init__(self, folder: Path | str, items: Iterable[str], remainders: bool = False,
                 size_limit: int = 0, buffers: int = BUFFERS, threads: int = THREADS,
                 direct: bool = True, pin=None):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise UserError(self.folder, "is not a folder",
                            "create it, or set budget.nvme_dir to a folder on a fast disk")
        self.items, self.remainders = frozenset(items), remainders
        self.size_limit, self.n_buffers = size_limit, max(1, buffers)
        self.direct: bool | None = None if direct and hasattr(os, "O_DIRECT") else False
        """Whether the files use O_DIRECT (None until the first file is open)."""
        self.files: dict[str, DiskItem] = {}
        self.bytes = 0
        """File bytes of all items."""
        self.bytes_read = self.bytes_written = 0
        self._buf_bytes = 0
        self._free: list[mmap.mmap] = []
        self._allocated = 0
        self._releases = 0
        self._queue: deque[DiskItem] = deque()
        self._cond = threading.Condition()
        self._error: OSError | None = None
        self._io = ThreadPoolExecutor(threads, "nvme-io")
        self._pin = pin

    # ---- setup -------------------------------------------------------------------------------
    def place(self, name: str, numel: int, fields: dict[str, torch.dtype]) -> DiskItem | None:
        """The item's file holding those of ``fields`` the tier keeps, if the item is chosen."""
        if name not in self.items:
            return None
        keep = ("w", "rem", "m", "v") if self.remainders else ("w", "m", "v")  # w: frozen only
        item = DiskItem(self, name, numel, {k: d for k, d in fields.items() if k in keep})
        if self._allocated:
            raise RuntimeError("NVMe tier: items are placed before the first staging")
        if self.size_limit and self.bytes + item.nbytes > self.size_limit:
            raise UserError("budget.nvme_size", f"is {self.size_limit / GiB:.2f} GiB; the NVMe tier "
                            f"needs about {self._need(item) / GiB:.2f} GiB ({len(self.items)} layers, "
                            f"{item.nbytes / GiB:.2f} GiB each)",
                            "raise budget.nvme_size, or raise budget.ram so fewer layers go to disk")
        item.fd = self._create(item)
        self.files[name] = item
        self.bytes += item.nbytes
        self._buf_bytes = max(self._buf_bytes, item.nbytes)
        return item

    def _create(self, item: DiskItem) -> int:
        path = self.folder / f".slideformer-{os.getpid()}-{secrets.token_hex(6)}.state"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        fd = -1
        try:
            if self.direct is not False:
                try:
                    fd = os.open(path, flags | os.O_DIRECT, 0o600)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct = False
            if fd < 0:
                fd = os.open(path, flags, 0o600)
            self._allocate(fd, item)
            if self.direct is None:
                self.direct = self._probe(fd)
                if not self.direct:
                    os.close(fd)
                    fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            if isinstance(e, OSError):
                raise UserError(self.folder, f"cannot hold the NVMe tier's files ({e.strerror or e})",
                                "choose a writable folder on a local disk for budget.nvme_dir") from None
            raise
        finally:
            path.unlink(missing_ok=True)
        return fd

    def _need(self, item: DiskItem) -> int:
        """File bytes of all chosen items (the layers have one size)."""
        return self.bytes + (len(self.items) - len(self.files)) * item.nbytes

    def _allocate(self, fd: int, item: DiskItem) -> None:
        try:
            os.posix_fallocate(fd, 0, item.nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.folder).free + self.bytes
                raise UserError(self.folder, f"has no room for the NVMe tier: it needs "
                                f"{self._need(item) / GiB:.2f} GiB, {free / GiB:.2f} GiB is free",
                                "free space on that disk, choose another budget.nvme_dir, or "
                                "raise budget.ram so fewer layers go to disk") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, item.nbytes)  # no preallocation here: blocks come at the first write

    @staticmethod
    def _probe(fd: int) -> bool:
        """Whether direct reads work on this file (some filesystems open O_DIRECT, then refuse)."""
        buf = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [buf], 0)
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return False
        finally:
            buf.close()

    # ---- staging -----------------------------------------------------------------------------
    def prefetch(self, item: DiskItem, tl=None) -> None:
        """Start reading the item ahead of its acquire (in call order, as buffers allow)."""
        with self._cond:
            self._check()
            item.wanted = True
            if item.where is Where.ON_DISK:
                item.where = Where.QUEUED
                item.tl = tl
                self._queue.append(item)
                self._pump()

    def acquire(self, item: DiskItem, tl=None) -> dict[str, torch.Tensor]:
        """Wait until the item is in a staging buffer (reading it now if needed); its views."""
        with self._cond:
            while True:
                self._check()
                if item.where is Where.READY:
                    item.where, item.wanted = Where.IN_USE, False
                    return item.views(item.buf)
                if item.where is Where.IN_USE:
                    raise RuntimeError(f"NVMe tier: {item.name} is acquired twice")
                if item.where in (Where.ON_DISK, Where.QUEUED):
                    buf = self._take_buffer(urgent=True)
                    if buf is not None:
                        if item.where is Where.QUEUED:
                            self._queue.remove(item)
                        self._start(item, buf, False, tl)
                        continue
                item.waiting += 1
                try:
                    self._cond.wait()
                finally:
                    item.waiting -= 1

    def release(self, item: DiskItem, write: bool, tl=None) -> None:
        """Hand the item back: written behind if ``write`` (it changed), else kept as READY."""
        with self._cond:
            if item.where is not Where.IN_USE:
                raise RuntimeError(f"NVMe tier: {item.name} is released but not acquired")
            self._releases += 1
            item.used = self._releases
            if write:
                self._start(item, item.buf, True, tl)
            else:
                item.where = Where.READY
                self._pump()
                self._cond.notify_all()

    def flush(self, item: DiskItem | None = None) -> None:
        """Wait for the I/O of ``item`` (or of every item) in flight; raise a failed one's error."""
        with self._cond:
            busy = (Where.READING, Where.WRITING)
            while any(it.where in busy for it in ([item] if item else self.files.values())):
                self._cond.wait()
            self._check()

    def mapped(self, item: DiskItem) -> dict[str, torch.Tensor]:
        """The item's fields as tensors over a shared mapping of its file (for checkpoints).

        Reading them reads the file, writing them writes it; call when no update runs.
        """
        with self._cond:
            while item.where in (Where.READING, Where.WRITING):
                self._cond.wait()
            self._check()
            if item.where is Where.IN_USE:
                raise RuntimeError(f"NVMe tier: {item.name} is mapped while it updates")
            if item.where is Where.QUEUED:
                self._queue.remove(item)
            if item.where is Where.READY:
                self._free.append(item.buf)
            item.where, item.buf, item.wanted, item.synced = Where.ON_DISK, None, False, False
        return item.views(mmap.mmap(item.fd, item.nbytes))

    def close(self) -> None:
        """Wait for the I/O in flight, stop the I/O threads, close (and so free) the files.

        A failed tier closes without raising again (its error was raised to the run).
        """
        with self._cond:
            while any(it.where in (Where.READING, Where.WRITING) for it in self.files.values()):
                self._cond.wait()
        self._io.shutdown()
        for item in self.files.values():
            if item.fd >= 0:
                os.close(item.fd)
                item.fd = -1
        self._free.clear()

    def __enter__(self) -> "NvmeTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inside the lock ---------------------------------------------------------------------
    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _take_buffer(self, urgent: bool) -> mmap.mmap | None:
        """A free buffer, a new one within the pool, or a READY item's (unwanted first, then
        least recently used; wanted ones only when ``urgent``)."""
        if self._free:
            return self._free.pop()
        if self._allocated < self.n_buffers:
            self._allocated += 1
            buf = mmap.mmap(-1, self._buf_bytes)  # page-aligned, zero-filled
            if self._pin is not None:
                self._pin(buf)
            return buf
        ready = [it for it in self.files.values()
                 if it.where is Where.READY and not it.waiting and (urgent or not it.wanted)]
        if not ready:
            return None
        victim = min(ready, key=lambda it: (it.wanted, it.used))
        buf = victim.buf
        victim.where, victim.buf, victim.wanted = Where.ON_DISK, None, False
        return buf

    def _pump(self) -> None:
        """Start queued reads, in order, while buffers are free."""
        while self._queue:
            head = self._queue[0]
            if head.where is not Where.QUEUED:  # acquired or mapped meanwhile
                self._queue.popleft()
                continue
            buf = self._take_buffer(urgent=False)
            if buf is None:
                return
            self._queue.popleft()
            self._start(head, buf, False, head.tl)

    def _start(self, item: DiskItem, buf: mmap.mmap, write: bool, tl) -> None:
        if not write and not item.synced:
            if self.direct:  # a mapping may have written the page cache since: flush it first
                os.fdatasync(item.fd)
            item.synced = True
        item.buf, item.where = buf, (Where.WRITING if write else Where.READING)
        starts = range(0, item.nbytes, IO_CHUNK)
        op = _Op(item, write, len(starts), tl)
        for s in starts:
            self._io.submit(self._request, op, s, min(IO_CHUNK, item.nbytes - s))

    # ---- on the I/O threads ------------------------------------------------------------------
    def _request(self, op: _Op, offset: int, n: int) -> None:
        t0, error = time.perf_counter(), None
        try:
            with memoryview(op.item.buf) as mv:
                _transfer(op.item.fd, mv[offset:offset + n], offset, op.write)
        except Exception as e:  # noqa: BLE001 -- handed to the thread that waits for the item
            error = e
        with self._cond:
            op.t0 = t0 if op.t0 is None else min(op.t0, t0)
            op.error = op.error or error
            op.left -= 1
            if op.left == 0:
                self._finish(op)

    def _finish(self, op: _Op) -> None:
        item = op.item
        if op.tl is not None:
            op.tl.host_span("disk", item.name, op.t0, time.perf_counter())
        if op.error is not None:
            e, what = op.error, "writing" if op.write else "reading"
            state = "base weights" if "w" in item.fields else "optimizer state"
            self._error = self._error or OSError(
                getattr(e, "errno", None) or errno.EIO,
                f"NVMe tier: {what} the {state} of {item.name} in {self.folder} failed: "
                f"{getattr(e, 'strerror', None) or e}")
            self._free.append(item.buf)
            item.where, item.buf = Where.ON_DISK, None
        else:
            if op.write:
                self.bytes_written += item.nbytes
            else:
                self.bytes_read += item.nbytes
            item.where = Where.READY
        self._pump()
        self._cond.notify_all()


def _transfer(fd: int, mv: memoryview, offset: int, write: bool) -> None:
    """The whole of ``mv`` to or from the file at ``offset`` (short transfers continued)."""
    done = 0
    while done < len(mv):
        part = mv[done:]
        n = os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "unexpected end of file")
        done += n
