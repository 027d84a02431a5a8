"""Transfer/compute backends with one interface: CUDA streams and a synchronous CPU stand-in.

Async work is ``start_*() -> Handle`` plus ``Handle.wait()`` (host blocks) or
``Backend.compute_waits(handle)`` (the compute stream waits, the host does not). The CUDA
backend runs host->device copies on one stream and device->host copies on another, so both PCIe
directions are busy at once while the compute stream runs; ordering is by CUDA events only.
The CPU backend does each copy at once and its handles are always complete, so the trainer's
schedule runs unchanged (and deterministically) on a machine without a GPU.
"""
from __future__ import annotations

import time

import torch

from slideformer.engine.devices import device_kind
from slideformer.engine.errors import UserError


class DoneHandle:
    """A handle whose work already finished (CPU backend)."""

    def __init__(self):
        self.t = time.perf_counter()

    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True


class CudaHandle:
    """A CUDA event recorded after some work on a stream."""

    def __init__(self, stream: torch.cuda.Stream):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)

    def wait(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


class CpuBackend:
    """Synchronous backend: "device" buffers are ordinary CPU tensors."""

    device = torch.device("cpu")
    is_cuda = False

    def alloc(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def host_alloc(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def start_h2d(self, dst: torch.Tensor, src: torch.Tensor, after=()) -> DoneHandle:
        return self._copy(dst, src)

    def start_d2h(self, dst: torch.Tensor, src: torch.Tensor, after=()) -> DoneHandle:
        return self._copy(dst, src)

    @staticmethod
    def _copy(dst, src) -> DoneHandle:
        start = DoneHandle()
        dst.copy_(src)
        end = DoneHandle()
        end.start = start
        return end

    def mark(self) -> DoneHandle:
        """A point on the compute stream (everything issued so far)."""
        return DoneHandle()

    def compute_waits(self, handle) -> None:
        pass

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Tell the allocator a compute-stream tensor is read by a copy stream."""

    def pin_mapping(self, buf) -> None:
        pass

    def release_host(self) -> None:
        pass

    def peak_memory(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        pass


class CudaBackend:
    """CUDA backend: compute on the current stream, H2D and D2H on their own streams."""

    is_cuda = True

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        self.compute = torch.cuda.current_stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)
        self._registered: list[torch.Tensor] = []

    def alloc(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def host_alloc(self, shape, dtype) -> torch.Tensor:
        """Page-locked host memory of exactly this size.

        ``pin_memory()`` goes through PyTorch's caching host allocator, which rounds each block
        up to a power of two (up to 2x the RAM for model-sized buffers); registering an
        ordinary allocation pins exactly the bytes asked for.
        """
        t = torch.zeros(shape, dtype=dtype)
        if t.numel():
            self._register(t, t.numel() * t.element_size())
        return t

    def pin_mapping(self, buf) -> None:
        """Page-lock a host mapping (an NVMe staging buffer) until :meth:`release_host`; the
        tensor kept over it also keeps the mapping alive until then."""
        t = torch.frombuffer(buf, dtype=torch.uint8)
        self._register(t, t.numel())

    def _register(self, t: torch.Tensor, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        if err:
            why = {2: "not enough page-lockable memory (see `ulimit -l`)",
                   712: "the range is registered already: memory pinned earlier in this process "
                        "was freed without release_host()"}.get(err, "")
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**20:.1f} MiB failed with CUDA "
                               f"error {err}" + (f": {why}" if why else ""))
        self._registered.append(t)

    def release_host(self) -> None:
        """Unpin what :meth:`host_alloc` and :meth:`pin_mapping` pinned (before the tensors are
        freed). Waits for the copy streams first: a copy still reading pinned memory must end
        before its pages are unpinned."""
        if not self._registered:
            return
        with torch.cuda.device(self.device):
            self.h2d.synchronize()
            self.d2h.synchronize()
            for t in self._registered:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()

    def __del__(self):
        # A backend dropped without release_host() (a run that raised, a test) would free its
        # pinned tensors still registered; CUDA then refuses to pin whatever the allocator puts
        # at those addresses next ("already registered"). Its tensors are alive until this
        # returns, so unregistering here keeps the order right.
        try:
            self.release_host()
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
            pass

    def _copy(self, stream, dst, src, after) -> CudaHandle:
        for h in after:
            if isinstance(h, CudaHandle):
                stream.wait_event(h.event)
        start = CudaHandle(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        end = CudaHandle(stream)
        end.start = start
        return end

    def start_h2d(self, dst, src, after=()) -> CudaHandle:
        """Copy host->device once every handle in ``after`` completed (on the GPU)."""
        return self._copy(self.h2d, dst, src, after)

    def start_d2h(self, dst, src, after=()) -> CudaHandle:
        return self._copy(self.d2h, dst, src, after)

    def mark(self) -> CudaHandle:
        return CudaHandle(self.compute)

    def compute_waits(self, handle) -> None:
        if isinstance(handle, CudaHandle):
            self.compute.wait_event(handle.event)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.d2h)

    def peak_memory(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def make_backend(device: str):
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available)."""
    if device_kind(device, torch.cuda.is_available()) == "cuda":
        device = "cuda" if device == "auto" else device
        if not torch.cuda.is_available():
            raise UserError("train.device", "is 'cuda' but no CUDA GPU is available",
                            "set train.device = \"cpu\" or install a CUDA build of torch")
        return CudaBackend(device)
    return CpuBackend()
