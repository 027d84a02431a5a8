"""The machine a plan is for: this machine, or a GPU preset the user picks.

"This machine" is its ``slideformer bench --hardware`` profile when one was measured; without
one, :func:`uncalibrated` builds it from what NVML and psutil see here: the GPU's speed from its
model (:data:`PRESETS`, by the name NVML gives), PCIe from the link NVML reports, the CPU AdamW
rate from the cores, the disk assumed; each figure says where it came from
(``HardwareProfile.sources``). With no NVIDIA GPU here the plan is for the CPU backend, which is
what ``train.device = "auto"`` runs here.

A preset is a consumer, workstation or data-centre GPU with its vendor-published memory, dense
bf16 tensor throughput and PCIe link; its host figures (CPU AdamW, disk) are this machine's, measured or
assumed, and the RAM and disk budgets are what the user types.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.plan.hardware import HardwareProfile, cache_file, read_profile
from slideformer.engine.plan.machine import GpuMemory, cpu_cores, gpu_memory, host_memory

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
    nvml: tuple[str, ...] = ()
    """The names NVML gives this GPU (compared without case, spacing or a leading "NVIDIA")."""


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
#   L40S (48 GB): NVIDIA L40S datasheet, 362.05 dense bf16, PCIe 4.0 x16.
# - Data-centre GPUs, by the names NVML gives them: H200 (SXM, 141 GB) and H100 SXM (80 GB
#   HBM3): NVIDIA H200 / H100 datasheets, 1,979 sparse -> 989 dense bf16 TFLOP/s, PCIe 5.0 x16;
#   H200 NVL and H100 NVL: 1,671 sparse -> 835; H100 PCIe: 1,513 sparse -> 756, PCIe 5.0 x16;
#   A100 (SXM4 and PCIe, 40 and 80 GB): NVIDIA A100 datasheet, 312 dense, PCIe 4.0 x16.
# Memory sizes and PCIe links: the vendor's spec page of each card.
GiB = 1 << 30
PRESETS: dict[str, GpuPreset] = {p.key: p for p in (
    GpuPreset("rtx3060", "NVIDIA GeForce RTX 3060 12 GB", 12 * GiB, 25.5, 4, 16,
              ("NVIDIA GeForce RTX 3060",)),
    GpuPreset("rtx3080", "NVIDIA GeForce RTX 3080 10 GB", 10 * GiB, 59.5, 4, 16,
              ("NVIDIA GeForce RTX 3080",)),
    GpuPreset("rtx3090", "NVIDIA GeForce RTX 3090 24 GB", 24 * GiB, 71.0, 4, 16,
              ("NVIDIA GeForce RTX 3090",)),
    GpuPreset("rtx4060ti", "NVIDIA GeForce RTX 4060 Ti 16 GB", 16 * GiB, 44.1, 4, 8,
              ("NVIDIA GeForce RTX 4060 Ti",)),
    GpuPreset("rtx4080", "NVIDIA GeForce RTX 4080 16 GB", 16 * GiB, 97.5, 4, 16,
              ("NVIDIA GeForce RTX 4080",)),
    GpuPreset("rtx4090", "NVIDIA GeForce RTX 4090 24 GB", 24 * GiB, 165.2, 4, 16,
              ("NVIDIA GeForce RTX 4090",)),
    GpuPreset("rtx5080", "NVIDIA GeForce RTX 5080 16 GB", 16 * GiB, 112.6, 5, 16,
              ("NVIDIA GeForce RTX 5080",)),
    GpuPreset("rtx5090", "NVIDIA GeForce RTX 5090 32 GB", 32 * GiB, 209.5, 5, 16,
              ("NVIDIA GeForce RTX 5090",)),
    GpuPreset("rtxa6000", "NVIDIA RTX A6000 48 GB", 48 * GiB, 154.8, 4, 16, ("NVIDIA RTX A6000",)),
    GpuPreset("l40s", "NVIDIA L40S 48 GB", 48 * GiB, 362.05, 4, 16, ("NVIDIA L40S",)),
    GpuPreset("h200", "NVIDIA H200 141 GB", 141 * 10**9 // GiB * GiB, 989.0, 5, 16, ("NVIDIA H200",)),
    GpuPreset("h200nvl", "NVIDIA H200 NVL 141 GB", 141 * 10**9 // GiB * GiB, 835.5, 5, 16,
              ("NVIDIA H200 NVL",)),
    GpuPreset("h100", "NVIDIA H100 80GB HBM3 80 GB", 80 * GiB, 989.0, 5, 16,
              ("NVIDIA H100 80GB HBM3",)),
    GpuPreset("h100pcie", "NVIDIA H100 PCIe 80 GB", 80 * GiB, 756.0, 5, 16, ("NVIDIA H100 PCIe",)),
    GpuPreset("h100nvl", "NVIDIA H100 NVL 94 GB", 94 * 10**9 // GiB * GiB, 835.5, 5, 16,
              ("NVIDIA H100 NVL",)),
    GpuPreset("a100", "NVIDIA A100-SXM4-80GB 80 GB", 80 * GiB, 312.0, 4, 16,
              ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB")),
    GpuPreset("a100pcie", "NVIDIA A100 80GB PCIe 80 GB", 80 * GiB, 312.0, 4, 16,
              ("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB")),
)}

# What the reference machine reaches of the published figures (an H200, PCIe 5.0 x16), applied
# to every GPU known by name. Matmul: `slideformer bench --hardware` measured 730-791 TFLOP/s
# for 8192^3 bf16 there (2026-11-29 to 12-01) against 989 published; the share taken is 759's,
# because speed.LAYER_EFFICIENCY gives a layer's rate as a share of those same 759 TFLOP/s, so
# the product is the layer rate measured (a 730 here planned the 70B QLoRA run 4% slower).
# PCIe: pinned copies at 55 GB/s of the link's 63.0 one way alone and 48 GB/s each way both at
# once (shared/GPU_MACHINE.md).
MATMUL_SHARE = 759 / 989
PCIE_SHARE, DUPLEX_SHARE = 55 / 63.0, 48 / 63.0
LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
"""Usable bytes per lane and direction of each PCIe generation, GB/s (after line coding)."""
CONSERVATIVE = "rtx3060"
"""The preset whose speed a GPU not known by name is assumed to have: the slowest."""

# Host figures of a machine nothing was measured on.
ADAM_PER_CORE = 4.7e9 / 16
"""CPU AdamW (runtime.host_state.adam_update, the compiled kernel) per physical core: `slideformer
bench --hardware` measured 4.7-4.75 G params/s on the reference's 16 Xeon cores (benchmarks/
RESULTS.md 2026-12-01 third session; tests/fixtures/hardware/h200.json). The update is bound by
memory bandwidth there, so few cores do better per core (2 EPYC cores: 3.0 G params/s on 16.8 M
params, RESULTS.md 2026-11-29): for them this is a floor."""
ADAM_CORES = 16
"""The update waits on memory more than on arithmetic: more cores than the 16 it was measured
on are not assumed to make it faster."""
ASSUMED_DISK = dict(disk_read_gbs=1.5, disk_write_gbs=1.0)
"""A typical desktop SSD (the reference's reads 1.7-2.0, writes 1.5-1.8 GB/s)."""
CORE_TFLOPS = 0.05
"""fp32 matmul rate per physical core a training step reaches (AVX2/AVX-512 desktop cores run
0.05-0.1 on large matrices; SmolLM2-135M's steps reached 0.049 per core on the 2-core development
machine, 2026-12-01)."""
UNCALIBRATED = "uncalibrated: run `slideformer bench --hardware` to measure this machine"


def gpu_names() -> str:
    """The targets ``--gpu`` takes, for help texts."""
    return ", ".join([THIS, *PRESETS])


def link_fields(gen: int, lanes: int) -> dict:
    """PCIe figures of a link (HardwareProfile fields) at what the reference's link reached."""
    link = LANE_GBS[gen] * lanes
    return dict(h2d_gbs=link * PCIE_SHARE, d2h_gbs=link * PCIE_SHARE, duplex_gbs=link * DUPLEX_SHARE)


def preset_fields(p: GpuPreset) -> dict:
    """A preset's GPU figures as HardwareProfile fields (no measured layer efficiency: this
    machine's GPU measured its own, so the preset takes the reference figures)."""
    return dict(gpu=p.name, vram_total=p.vram_bytes, matmul_tflops=p.bf16_tflops * MATMUL_SHARE,
                layer_efficiency=(), **link_fields(p.pcie_gen, p.pcie_lanes))


def preset_sources(p: GpuPreset) -> tuple[tuple[str, str], ...]:
    """Where a preset's GPU figures come from, in the words plans print."""
    matmul = (f"from the GPU model ({p.name.rsplit(' ', 2)[0]}: {p.bf16_tflops:g} dense bf16 "
              f"TFLOP/s published x {MATMUL_SHARE:.2f} reached on the reference H200)")
    link = f"from the GPU model's link (PCIe {p.pcie_gen}.0 x{p.pcie_lanes}{_LINK_SHARE})"
    return (("matmul_tflops", matmul), *((f, link) for f in _GPU_FIGURES[1:]))


_GPU_FIGURES = ("matmul_tflops", "h2d_gbs", "d2h_gbs", "duplex_gbs")
_LINK_SHARE = f", x {PCIE_SHARE:.2f} one way / {DUPLEX_SHARE:.2f} both ways as on the reference"


def _key(name: str) -> str:
    words = name.casefold().replace("-", " ").split()
    return " ".join(words[1:] if words[:1] == ["nvidia"] else words)


def known_gpu(nvml_name: str) -> GpuPreset | None:
    """The preset of a GPU by the name NVML gives it (e.g. "NVIDIA GeForce RTX 4090"), or None."""
    key = _key(nvml_name)
    return next((p for p in PRESETS.values() if key in map(_key, p.nvml)), None)


def uncalibrated(gpu: GpuMemory | None, ram_total: int, cores: int) -> HardwareProfile:
    """This machine from the facts NVML (``gpu``; None: no NVIDIA GPU) and psutil give, nothing
    measured (the module docstring says how); a GPU not known by name is assumed as fast as the
    CONSERVATIVE preset, and says so."""
    capped = f", {ADAM_CORES} cores at most" if cores > ADAM_CORES else ""
    sources = [("cpu_tflops", f"from {cores} CPU cores x {CORE_TFLOPS:g} TFLOP/s each (assumed)"),
               ("adam_params_per_s", f"from {cores} CPU cores x {ADAM_PER_CORE / 1e9:.2f} G params/s "
                                     f"each (the reference's per-core rate{capped})"),
               *((f, "default (a typical desktop SSD)") for f in ASSUMED_DISK)]
    fields = dict(ASSUMED_DISK, gpu=None, vram_total=None, matmul_tflops=0.0, h2d_gbs=0.0,
                  d2h_gbs=0.0, duplex_gbs=0.0,
                  adam_params_per_s=ADAM_PER_CORE * min(cores, ADAM_CORES))
    notes = [UNCALIBRATED]
    if gpu is not None:
        preset = known_gpu(gpu.name)
        if preset is None:
            preset = PRESETS[CONSERVATIVE]
            notes.append(f"{gpu.name} is not a GPU the planner knows: assumed as fast as the "
                         f"{preset.name}")
            sources += [(f, f"default: {gpu.name} is not a GPU the planner knows, so the "
                            f"{preset.name}'s") for f in _GPU_FIGURES]
        else:
            sources += preset_sources(preset)
        fields.update(preset_fields(preset), gpu=gpu.name, vram_total=gpu.total)
        if gpu.pcie_gen in LANE_GBS and gpu.pcie_width:
            fields.update(link_fields(gpu.pcie_gen, gpu.pcie_width))
            link = f"from the link NVML reports (PCIe {gpu.pcie_gen}.0 x{gpu.pcie_width}{_LINK_SHARE})"
            sources += [(f, link) for f in _GPU_FIGURES[1:]]
    what = gpu.name if gpu else "no NVIDIA GPU"
    return HardwareProfile(name=f"this machine ({what}, not measured)", ram_total=ram_total,
                           cpu_cores=cores, cpu_tflops=CORE_TFLOPS * cores, notes=tuple(notes),
                           sources=tuple(sources), **fields)


def detected() -> HardwareProfile:
    """This machine as NVML and psutil see it now (:func:`uncalibrated`)."""
    return uncalibrated(gpu_memory(), host_memory().total, cpu_cores())


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
        mine = ("cpu_tflops", "adam_params_per_s", "disk_read_gbs", "disk_write_gbs")
        return dataclasses.replace(host, name=p.name, preset=p.key, measured=(),
                                   notes=(f"{p.name}: vendor figures (bf16 {p.bf16_tflops:g} "
                                          f"TFLOP/s, PCIe {p.pcie_gen}.0 x{p.pcie_lanes}); host "
                                          f"speeds of {host.name}",),
                                   sources=preset_sources(p) + tuple(
                                       (f, host.source(f)) for f in mine),
                                   **preset_fields(p))
    if target.endswith(".json") or os.path.sep in target:
        return read_profile(Path(target))
    raise UserError("--gpu", f"{target!r} is not a GPU the planner knows",
                    f"use one of: {gpu_names()}; or a profile file from `slideformer bench "
                    f"--hardware --json`")
