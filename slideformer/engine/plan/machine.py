"""What this machine has right now: GPU memory through NVML, host memory through psutil and,
inside a container, its cgroup's memory limit (a process past ``memory.max`` is killed, however
much RAM the machine has).

NVML comes from the ``pynvml`` module (package nvidia-ml-py). Without it, or without an NVIDIA
driver, the machine is reported as having no GPU; nothing here raises.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class GpuMemory:
    """Memory of GPU 0 as NVML reports it."""
    name: str
    total: int
    free: int
    """Bytes no process holds."""
    own: int
    """Bytes this process holds already (its CUDA context, once created)."""


CGROUP = "/sys/fs/cgroup"
"""Where the cgroup files are mounted (v2: memory.max; v1: memory/memory.limit_in_bytes)."""


@dataclass(frozen=True)
class HostMemory:
    total: int
    """The machine's RAM, or the cgroup's limit where that is lower."""
    available: int
    """Bytes the OS can give without swapping (psutil's ``available``), within the cgroup's
    limit less what the cgroup uses."""
    own: int
    """Resident bytes of this process."""


def gpu_memory(index: int = 0) -> GpuMemory | None:
    """GPU ``index``'s memory, or None when NVML or an NVIDIA GPU is absent."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU: NVMLError subclasses, or OSError from the loader
        return None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        name = pynvml.nvmlDeviceGetName(h)
        return GpuMemory(name.decode() if isinstance(name, bytes) else str(name),
                         int(mem.total), int(mem.free), _own_gpu_bytes(pynvml, h))
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _own_gpu_bytes(pynvml, handle) -> int:
    """Bytes this process uses on the GPU (0 when NVML cannot tell, e.g. inside containers)."""
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return 0
    pid = os.getpid()
    return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == pid)


def host_memory() -> HostMemory:
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    limit = cgroup_limit()
    if limit is not None and limit < total:
        total, available = limit, min(available, max(0, limit - (cgroup_usage() or 0)))
    return HostMemory(total, available, int(psutil.Process().memory_info().rss))


def _read_int(*parts: str) -> int | None:
    """An integer cgroup file, or None (absent, unreadable, or "max": no limit)."""
    try:
        text = open(os.path.join(CGROUP, *parts), encoding="ascii").read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes, or None where none is set."""
    v2 = _read_int("memory.max")
    return v2 if v2 is not None else _read_int("memory", "memory.limit_in_bytes")


def cgroup_usage() -> int | None:
    v2 = _read_int("memory.current")
    return v2 if v2 is not None else _read_int("memory", "memory.usage_in_bytes")
