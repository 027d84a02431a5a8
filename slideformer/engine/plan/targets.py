"""The machine a plan is for: this machine, or a GPU preset the user picks.

"This machine" is its ``slideformer bench --hardware`` profile when one was measured; without
one, what NVML and psutil see here, with the speeds of the matching preset (a GPU we know by
name) or, for what nothing here tells, the assumed figures of :data:`ASSUMED` (marked as such
in the profile's name and notes). With no NVIDIA GPU here the plan is for the CPU backend,
which is what ``train.device = "auto"`` runs here.

A preset is a consumer, workstation or data-centre GPU with its vendor-published memory, dense
bf16 tensor throughput and PCIe link; its host figures (CPU AdamW, disk) are this machine's, measured or
assumed, and the RAM and disk budgets are what the user types.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from slideformer.engine.errors import UserError
from slideformer.engine.plan.hardware import HardwareProfile, cache_file, read_profile
from slideformer.engine.plan.machine import gpu_memory, host_memory

THIS = "this"
"""The target name of this machine."""


@dataclass(frozen=True)
class GpuPreset:
    """A GPU as its vendor publishes it."""
    key: str
    """What ``slideformer plan --gpu`` takes, e.g. ``rtx4090``."""
    name: str
    vram_bytes: int
    """Memory; the marketed "24 GB" of these cards is 24 GiB."""
    bf16_tflops: float
    """Dense (no sparsity) bf16 tensor throughput with fp32 accumulation, TFLOP/s: what a
    PyTorch bf16 matmul runs at."""
    pcie_gen: int
    pcie_lanes: int


# Sources (vendor figures; dense bf16 tensor TFLOP/s with fp32 accumulate, the half of the
# "sparse" figure the spec sheets headline):
# - GeForce RTX 3080 / 3090: NVIDIA Ampere GA102 GPU Architecture whitepaper, Table 2/3
#   ("Peak BF16 Tensor TFLOPS with FP32 Accumulate" 59.5 / 71). RTX 3060 (GA106): the same
#   per-SM rate (128 dense FMA-pairs per tensor core per clock with fp32 accumulate) x 112 tensor
#   cores x 1.777 GHz boost (NVIDIA RTX 3060 spec page) = 25.5.
# - RTX 4080 / 4090: NVIDIA Ada GPU Architecture whitepaper, Appendix A (97.5 / 165.2).
#   RTX 4060 Ti 16 GB (AD106): the same per-tensor-core rate x 136 tensor cores x 2.535 GHz
#   boost (NVIDIA 4060 Ti spec page) = 44.1; its link is PCIe 4.0 x8.
# - RTX 5080 / 5090: NVIDIA RTX Blackwell GPU Architecture whitepaper, Appendix A (112.6 /
#   209.5); PCIe 5.0 x16.
# - RTX A6000 (48 GB): NVIDIA RTX A6000 datasheet, 309.7 sparse -> 154.8 dense TFLOP/s.
# - Data-centre GPUs, by the names NVML gives them: H200 (SXM, 141 GB) and H100 SXM (80 GB
#   HBM3): NVIDIA H200 / H100 datasheets, 1,979 sparse -> 989 dense bf16 TFLOP/s, PCIe 5.0 x16;
#   A100 SXM4 80 GB: NVIDIA A100 datasheet, 312 dense, PCIe 4.0 x16.
# Memory sizes and PCIe links: the vendor's spec page of each card.
GiB = 1 << 30
PRESETS: dict[str, GpuPreset] = {p.key: p for p in (
    GpuPreset("rtx3060", "NVIDIA GeForce RTX 3060 12 GB", 12 * GiB, 25.5, 4, 16),
    GpuPreset("rtx3080", "NVIDIA GeForce RTX 3080 10 GB", 10 * GiB, 59.5, 4, 16),
    GpuPreset("rtx3090", "NVIDIA GeForce RTX 3090 24 GB", 24 * GiB, 71.0, 4, 16),
    GpuPreset("rtx4060ti", "NVIDIA GeForce RTX 4060 Ti 16 GB", 16 * GiB, 44.1, 4, 8),
    GpuPreset("rtx4080", "NVIDIA GeForce RTX 4080 16 GB", 16 * GiB, 97.5, 4, 16),
    GpuPreset("rtx4090", "NVIDIA GeForce RTX 4090 24 GB", 24 * GiB, 165.2, 4, 16),
    GpuPreset("rtx5080", "NVIDIA GeForce RTX 5080 16 GB", 16 * GiB, 112.6, 5, 16),
    GpuPreset("rtx5090", "NVIDIA GeForce RTX 5090 32 GB", 32 * GiB, 209.5, 5, 16),
    GpuPreset("rtxa6000", "NVIDIA RTX A6000 48 GB", 48 * GiB, 154.8, 4, 16),
    GpuPreset("h200", "NVIDIA H200 141 GB", 141 * 10**9 // GiB * GiB, 989.0, 5, 16),
    GpuPreset("h100", "NVIDIA H100 80GB HBM3 80 GB", 80 * GiB, 989.0, 5, 16),
    GpuPreset("a100", "NVIDIA A100-SXM4-80GB 80 GB", 80 * GiB, 312.0, 4, 16),
)}

# What a measured machine reaches of its published figures, applied to the presets (one
# GPU measured with `slideformer bench --hardware`, 2026-11-29: an H200, PCIe 5.0 x16): an
# 8192^3 bf16 matmul ran at 730 of the 989 dense TFLOP/s published for the H200 SXM (the
# least share of the H200 parts, so the presets are not flattered); pinned copies at 55 GB/s
# of the link's 63.0 one way alone and 48 GB/s each way both at once.
MATMUL_SHARE = 730 / 989
PCIE_SHARE, DUPLEX_SHARE = 55 / 63.0, 48 / 63.0
LANE_GBS = {3: 0.985, 4: 1.969, 5: 3.938}
"""Usable bytes per lane and direction of each PCIe generation, GB/s (after line coding)."""

# Host figures of a machine nothing was measured on: a typical desktop (assumed, said so).
ASSUMED = dict(adam_params_per_s=1.0e9, disk_read_gbs=1.5, disk_write_gbs=1.0)
CORE_TFLOPS = 0.05
"""fp32 matmul rate per physical core a training step reaches (AVX2/AVX-512 desktop cores run
0.05-0.1 on large matrices; SmolLM2-135M's steps reached 0.049 per core on the 2-core development
machine, 2026-12-01)."""


def gpu_names() -> str:
    """The targets ``--gpu`` takes, for help texts."""
    return ", ".join([THIS, *PRESETS])


def preset_fields(p: GpuPreset) -> dict:
    """A preset's GPU figures as HardwareProfile fields (no measured layer efficiency: this
    machine's GPU measured its own, so the preset takes the reference figures)."""
    link = LANE_GBS[p.pcie_gen] * p.pcie_lanes
    return dict(gpu=p.name, vram_total=p.vram_bytes, matmul_tflops=p.bf16_tflops * MATMUL_SHARE,
                h2d_gbs=link * PCIE_SHARE, d2h_gbs=link * PCIE_SHARE, duplex_gbs=link * DUPLEX_SHARE,
                layer_efficiency=())


def _match(gpu_name: str) -> GpuPreset | None:
    """The preset of a GPU NVML names (e.g. "NVIDIA GeForce RTX 4090")."""
    found = [p for p in PRESETS.values() if p.name.rsplit(" ", 2)[0].lower() == gpu_name.lower()]
    return found[0] if found else None


def detected() -> HardwareProfile:
    """This machine as NVML and psutil see it, with the speeds of its GPU's preset (or of the
    smallest preset, for a GPU not known by name) and assumed host speeds; nothing measured."""
    gpu = gpu_memory()
    fields = dict(ASSUMED, gpu=None, vram_total=None, matmul_tflops=0.0, h2d_gbs=0.0,
                  d2h_gbs=0.0, duplex_gbs=0.0)
    notes = ["speeds are assumed, not measured: run `slideformer bench --hardware`"]
    if gpu is not None:
        preset = _match(gpu.name)
        if preset is None:
            preset = min(PRESETS.values(), key=lambda p: p.bf16_tflops)
            notes.append(f"{gpu.name} is not a GPU the planner knows: assumed as fast as the "
                         f"{preset.name}")
        fields.update(preset_fields(preset), gpu=gpu.name, vram_total=gpu.total)
    what = gpu.name if gpu else "no NVIDIA GPU"
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return HardwareProfile(name=f"this machine ({what}, not measured)",
                           ram_total=host_memory().total, cpu_cores=cores,
                           cpu_tflops=CORE_TFLOPS * cores, notes=tuple(notes), **fields)


def this_machine() -> HardwareProfile:
    """This machine: its measured profile (``bench --hardware``), else :func:`detected`."""
    path = cache_file()
    if not path.is_file():
        return detected()
    profile = read_profile(path)
    return dataclasses.replace(profile, name=f"this machine ({profile.gpu or 'no NVIDIA GPU'}, "
                                             f"measured)")


def load_profile(target: str = THIS) -> HardwareProfile:
    """The profile of ``target``: ``this``, a preset key (``rtx4090``) or a profile JSON file."""
    if target in (THIS, "auto", ""):
        return this_machine()
    key = target.lower().replace(" ", "").replace("-", "")
    if key in PRESETS:
        p = PRESETS[key]
        host = this_machine()
        return dataclasses.replace(host, name=p.name, preset=p.key, measured=(),
                                   notes=(f"{p.name}: vendor figures (bf16 {p.bf16_tflops:g} "
                                          f"TFLOP/s, PCIe {p.pcie_gen}.0 x{p.pcie_lanes}); host "
                                          f"speeds of {host.name}",), **preset_fields(p))
    if target.endswith(".json") or os.path.sep in target:
        return read_profile(Path(target))
    raise UserError("--gpu", f"{target!r} is not a GPU the planner knows",
                    f"use one of: {gpu_names()}; or a profile file from `slideformer bench "
                    f"--hardware --json`")
