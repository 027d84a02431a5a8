"""What this machine has right now: GPU memory and PCIe link through NVML, host memory and CPU
cores through psutil and, inside a container, its cgroup's memory limit (a process past
``memory.max`` is killed, however much RAM the machine has).

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
    pcie_gen: int | None = None
    """PCIe generation of the link, the most this GPU and its slot allow (NVML's max link
    generation: the current one drops at idle to save power); None: NVML cannot tell."""
    pcie_width: int | None = None
    """Lanes of that link (NVML's max link width: an x16 card in an x8 slot says 8)."""


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
                         int(mem.total), int(mem.free), _own_gpu_bytes(pynvml, h),
                         _query(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                         _query(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h))
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _query(fn, handle) -> int | None:
    """A positive integer NVML gives for ``handle``, or None (not supported here, e.g. a vGPU)."""
    try:
        value = int(fn(handle))
    except Exception:
        return None
    return value if value > 0 else None


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


def cpu_cores() -> int:
    """Physical cores this process may run on: psutil's count, no more than its CPU affinity
    allows (a container pinned to 4 CPUs of a 32-core host has 4)."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    try:
        return max(1, min(cores, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):  # no affinity on macOS / Windows
        return cores


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
    """Bytes the cgroup holds that it cannot give back: its usage less its inactive file cache
    (which the kernel reclaims before it kills anything; what kubelet calls the working set).
    Reading a model's files fills the cache up to the limit, and counting it would leave a
    container's plan no memory at all."""
    v2 = _read_int("memory.current")
    used = v2 if v2 is not None else _read_int("memory", "memory.usage_in_bytes")
    if used is None:
        return None
    key = "inactive_file" if v2 is not None else "total_inactive_file"
    stat = "memory.stat" if v2 is not None else os.path.join("memory", "memory.stat")
    return max(0, used - _stat(stat, key))


def _stat(name: str, key: str) -> int:
    """One counter of a cgroup memory.stat file (0 when absent)."""
    try:
        with open(os.path.join(CGROUP, name), encoding="ascii") as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key and v.strip().isdigit():
                    return int(v)
    except OSError:
        pass
    return 0
