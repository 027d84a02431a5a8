"""Memory budgets of a run: VRAM, host RAM and disk, from the config or from what the machine has.

``auto`` budgets leave a safety margin for everything that is not this run:
- VRAM: the GPU's free memory plus what this process holds already, less
  max(512 MiB, 3% of the GPU) for the display server, other programs and the driver's growth;
  when the plan is for a GPU preset (or no GPU is here), the profile's VRAM less the same margin.
- RAM: available memory plus this process's resident memory, less max(1 GiB, 3% of RAM).
  "Available" is the kernel's MemAvailable (psutil's ``available``; in a container, also no
  more than its cgroup limit less what the cgroup holds, slideformer.engine.plan.machine): what
  can be allocated without swapping, with the reclaimable page cache counted in and the kernel's
  own reserves already left out, so the margin only covers what the plan cannot see: other
  programs growing during the run and the planner's own error (its host peaks were 0.4-3% under
  the runs' VmHWM on the H200, benchmarks/RESULTS.md). It was max(2 GiB, 5%), which on the
  125.8 GiB H200 called the 70B QLoRA run (118.9 GiB planned) "does not fit", a verdict the
  trainer refuses to start, while it ran at 119.3 GiB RSS; now that run is "tight" (over
  TIGHT of the budget), which is what it was.
- Disk (the NVMe tier): none unless a folder is given; a folder without a size gets its free
  space less 5%.
A budget the user gives is taken as is, after checks: a readable size, positive, and no more
VRAM than the GPU has.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.config import BudgetConfig, format_bytes, parse_bytes
from slideformer.engine.errors import UserError
from slideformer.engine.plan.hardware import HardwareProfile
from slideformer.engine.plan.machine import GpuMemory, HostMemory

MiB, GiB = 1 << 20, 1 << 30


def vram_margin(total: int) -> int:
    return max(512 * MiB, int(0.03 * total))


def ram_margin(total: int) -> int:
    return max(GiB, int(0.03 * total))


@dataclass(frozen=True)
class Budgets:
    """Bytes the run may use per tier, and how each figure was arrived at."""
    vram: int | None
    """GPU memory for everything of this process on the GPU (CUDA context included);
    None: no GPU budget (CPU backend without an emulated cap)."""
    ram: int
    """Host memory (on the CPU backend it also holds the "device" buffers)."""
    disk: int
    """Disk for the NVMe tier; 0: no NVMe tier."""
    disk_path: str = ""
    vram_source: str = ""
    ram_source: str = ""
    disk_source: str = ""


def _size(text: str, where: str) -> int:
    value = parse_bytes(text, where)
    if value <= 0:
        raise UserError(where, f"{text!r} is not a positive size", "give a size such as 24GiB")
    return value


def _vram(text: str, device: str, profile: HardwareProfile, gpu: GpuMemory | None) -> tuple[int | None, str]:
    total = gpu.total if gpu else profile.vram_total
    what = f"the GPU ({gpu.name})" if gpu else f"the GPU of {profile.name}"
    if text.strip().lower() == "auto":
        if device != "cuda":
            return None, "none: the CPU backend keeps its buffers in host memory"
        if gpu:
            free = gpu.free + gpu.own
            return free - vram_margin(gpu.total), (f"auto: {format_bytes(free)} free on {gpu.name} "
                                                    f"less a {format_bytes(vram_margin(gpu.total))} margin")
        if total is None:
            raise UserError("budget.vram", "is auto but there is no GPU to measure",
                            "give the VRAM of the GPU to plan for, e.g. --vram 24GiB")
        return total - vram_margin(total), f"auto: {what} less a {format_bytes(vram_margin(total))} margin"
    value = _size(text, "budget.vram")
    if total is not None and value > total:
        raise UserError("budget.vram", f"{text} is more than {what} has ({format_bytes(total)})",
                        f"give at most {total / GiB:.1f}GiB, or plan for another machine with --gpu")
    return value, "given"


def _ram(text: str, host: HostMemory) -> tuple[int, str]:
    if text.strip().lower() == "auto":
        free = host.available + host.own
        return free - ram_margin(host.total), (f"auto: {format_bytes(free)} available less a "
                                               f"{format_bytes(ram_margin(host.total))} margin")
    return _size(text, "budget.ram"), "given"


def _disk(folder: str, size: str) -> tuple[int, str]:
    if not folder:
        if parse_bytes(size, "budget.nvme_size") > 0:
            raise UserError("budget.nvme_size", f"is {size} but no folder is given",
                            "set budget.nvme_dir (or --disk PATH:SIZE)")
        return 0, "none: no NVMe folder given"
    path = Path(folder)
    if not path.is_dir():
        raise UserError(path, "is not a folder", "create it, or give a folder on the NVMe disk")
    if size.strip().lower() in ("", "0", "auto"):
        free = shutil.disk_usage(path).free
        return int(0.95 * free), f"auto: {format_bytes(free)} free in {path} less 5%"
    return _size(size, "budget.nvme_size"), "given"


def resolve_budgets(cfg: BudgetConfig, device: str, profile: HardwareProfile,
                    gpu: GpuMemory | None, host: HostMemory) -> Budgets:
    """Budgets in bytes from the config's sizes (``auto`` = what the machine has less a margin).

    Args:
        device: ``cuda`` or ``cpu``, the backend the run uses.
        gpu, host: this machine's memory (slideformer.engine.plan.machine); ``gpu`` None without a GPU.
    """
    vram, vs = _vram(cfg.vram, device, profile, gpu)
    ram, rs = _ram(cfg.ram, host)
    disk, ds = _disk(cfg.nvme_dir, cfg.nvme_size)
    if vram is not None and vram <= 0:
        raise UserError("budget.vram", "leaves nothing once the safety margin is taken",
                        "free GPU memory, or give a budget explicitly")
    if ram <= 0:
        raise UserError("budget.ram", "leaves nothing once the safety margin is taken",
                        "free host memory, or give a budget explicitly")
    return Budgets(vram, ram, disk, cfg.nvme_dir, vs, rs, ds)
