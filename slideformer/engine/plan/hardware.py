"""The hardware profile the planner predicts speed with, where it comes from, and where it is kept.

A profile holds the figures that bound a sliding-window step: GPU matmul throughput, pinned PCIe
bandwidth each way, CPU AdamW throughput and disk bandwidth, plus the machine's memory sizes.
``slideformer bench --hardware`` measures them (slideformer.engine.plan.bench) and caches the result per
machine as JSON in the user cache folder. Which profile a plan uses (this machine, or a GPU
preset) is slideformer.engine.plan.targets' business.

:data:`REFERENCE` is one machine measured end to end (an H200 workstation): the speed model's
calibration (slideformer.engine.plan.speed) and the tests' and benchmarks' fixed machine. Product output
never plans for it unless asked to with its profile file.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.jsonfile import read_json

GiB = 1 << 30


@dataclass(frozen=True)
class HardwareProfile:
    """Throughput and capacity figures of one machine."""

    name: str
    """The machine in words, as plans name it ("this machine (...)", a GPU preset)."""
    gpu: str | None
    """GPU model, or None for a machine without an NVIDIA GPU."""
    vram_total: int | None
    """GPU memory in bytes (None: no GPU)."""
    ram_total: int
    """Host memory in bytes."""
    cpu_cores: int
    matmul_tflops: float
    """GPU bf16 dense matmul throughput (8192^3), TFLOP/s."""
    cpu_tflops: float
    """CPU fp32 dense matmul throughput, TFLOP/s (the CPU backend's compute)."""
    h2d_gbs: float
    """Pinned host->device copy bandwidth in GB/s (10^9 bytes/s), one direction alone."""
    d2h_gbs: float
    """Pinned device->host copy bandwidth in GB/s, one direction alone."""
    duplex_gbs: float
    """Bandwidth of each direction while both run at once, GB/s."""
    adam_params_per_s: float
    """CPU AdamW throughput of ``slideformer.engine.runtime.host_state.adam_update`` (bf16 + remainder
    master, fp32 moments), parameters per second."""
    disk_read_gbs: float
    disk_write_gbs: float
    adam_fallback_params_per_s: float | None = None
    """The same update through the PyTorch-op fallback (no C compiler); None: not measured,
    taken as FALLBACK_SHARE of ``adam_params_per_s``."""
    layer_efficiency: tuple[tuple[str, float], ...] = ()
    """Share of ``matmul_tflops`` one decoder layer's forward, recompute and backward reached
    here, per kernel path (slideformer.engine.kernels.dispatch.KernelPath.key, e.g.
    ``("fused+flex", 0.81)``), measured by ``slideformer bench --hardware``; a path not listed
    (older profiles: none) takes slideformer.engine.plan.speed.LAYER_EFFICIENCY."""
    measured: tuple[str, ...] = ()
    """Names of the fields measured on this machine; the others are defaults."""
    notes: tuple[str, ...] = field(default=())
    """What could not be measured, and why."""
    preset: str = ""
    """The GPU preset (slideformer.engine.plan.targets.PRESETS) this profile stands for; "" for a real
    machine."""
    sources: tuple[tuple[str, str], ...] = ()
    """Where the figures not in ``measured`` come from, as (field, words) pairs, e.g.
    ``("matmul_tflops", "from the GPU model (...)")``; a figure in neither is a default."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def source(self, figure: str) -> str:
        """Where the field ``figure`` comes from, in words."""
        if figure in self.measured:
            return "measured by `slideformer bench --hardware`"
        return dict(self.sources).get(figure, "default")

    def figure_lines(self) -> list[str]:
        """Each speed figure and where it came from: what plans print under the machine."""
        lines = []
        if self.gpu is not None:
            lines += [f"GPU bf16 matmul {self.matmul_tflops:.0f} TFLOP/s: {self.source('matmul_tflops')}",
                      f"PCIe {self.h2d_gbs:.1f} GB/s one way, {self.duplex_gbs:.1f} each way both at "
                      f"once: {self.source('h2d_gbs')}"]
        else:
            lines.append(f"CPU fp32 matmul {self.cpu_tflops:.2f} TFLOP/s: {self.source('cpu_tflops')}")
        return lines + [
            f"CPU AdamW {self.adam_params_per_s / 1e9:.2f} G params/s: "
            f"{self.source('adam_params_per_s')}",
            f"disk {self.disk_read_gbs:.1f} GB/s read, {self.disk_write_gbs:.1f} write: "
            f"{self.source('disk_read_gbs')}"]

    def without_native_adam(self, reason: str) -> "HardwareProfile":
        """This profile as the planner must see it when the compiled CPU AdamW is unavailable."""
        rate = self.adam_fallback_params_per_s or FALLBACK_SHARE * self.adam_params_per_s
        why = f"compiled CPU AdamW unavailable ({reason})"
        how = ("measured here" if self.adam_fallback_params_per_s else
               f"{FALLBACK_SHARE:.2f} of the compiled kernel's")
        return dataclasses.replace(
            self, adam_params_per_s=rate,
            measured=tuple(f for f in self.measured if f != "adam_params_per_s"),
            sources=self.sources + (("adam_params_per_s",
                                     f"the PyTorch fallback's rate ({how}): {why}"),),
            notes=self.notes + (f"{why}: the PyTorch fallback's {rate / 1e9:.2f} G params/s is used",))

    @staticmethod
    def from_dict(d: dict) -> "HardwareProfile":
        """The profile of a JSON object; ValueError names a figure that is absent or absurd."""
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not an object")
        names = {f.name for f in dataclasses.fields(HardwareProfile)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["measured"] = tuple(kw.get("measured", ()))
        kw["notes"] = tuple(kw.get("notes", ()))
        kw["layer_efficiency"] = _efficiencies(kw.get("layer_efficiency", ()))
        kw["sources"] = _sources(kw.get("sources", ()))
        _check_figures(kw)
        return HardwareProfile(**kw)


FALLBACK_SHARE = 0.87 / 3.01
"""Fallback / compiled CPU AdamW throughput, fp32 moments, measured on the development machine
(benchmarks/RESULTS.md: 0.87 vs 3.01 G params/s); used where the fallback was not measured."""
RATES = ("matmul_tflops", "cpu_tflops", "h2d_gbs", "d2h_gbs", "duplex_gbs", "adam_params_per_s",
         "disk_read_gbs", "disk_write_gbs")
"""The throughput figures of a profile (each must be a positive number)."""


def _efficiencies(pairs) -> tuple[tuple[str, float], ...]:
    """``layer_efficiency`` from JSON (a list of [path, share] pairs); ValueError names a pair
    that is not a known path with a share in (0, 1.5]."""
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"'layer_efficiency' is {pairs!r}, not a list of [path, share] pairs")
    if not pairs:
        return ()
    from slideformer.engine.kernels.dispatch import PATHS  # imports torch: only when needed
    out = []
    for pair in pairs:
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and pair[0] in PATHS
        v = pair[1] if ok else None
        if not ok or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1.5:
            raise ValueError(f"'layer_efficiency' holds {pair!r}, not a pair of a kernel path "
                             f"({', '.join(PATHS)}) and a share of the matmul rate")
        out.append((pair[0], float(v)))
    return tuple(out)


def _sources(pairs) -> tuple[tuple[str, str], ...]:
    """``sources`` from JSON (a list of [field, words] pairs); ValueError for anything else."""
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in pairs):
        raise ValueError(f"'sources' is {pairs!r}, not a list of [figure, source] pairs")
    return tuple((a, b) for a, b in pairs)


def _check_figures(kw: dict) -> None:
    """ValueError for a figure that is missing or absurd: the speed model divides by every rate,
    so a zero, negative or NaN figure would fail far from here."""
    missing = [f.name for f in dataclasses.fields(HardwareProfile) if f.name not in kw
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    sizes = ("ram_total", "cpu_cores") + (("vram_total",) if kw["vram_total"] is not None else ())
    for key in RATES + sizes:
        v = kw[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"'{key}' is {v!r}, not a positive number")
    v = kw.get("adam_fallback_params_per_s")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
        raise ValueError(f"'adam_fallback_params_per_s' is {v!r}, not a positive number")
    for key in ("name", "gpu"):
        if not isinstance(kw[key], str) and not (key == "gpu" and kw[key] is None):
            raise ValueError(f"'{key}' is {kw[key]!r}, not a string")


# The H200 workstation the project measures on. Sources: its measured ceilings (2026-11-29): bf16 matmul 8192^3 ~730 TFLOP/s; pinned PCIe 55 GB/s each way alone, 48 GB/s each
# way when both run at once; disk ~1.7 GB/s read, ~1.5 GB/s write. Measured there with
# `slideformer bench --hardware` (2026-11-29), as its ceilings list no such figure: our CPU
# AdamW (adam_update: the compiled one-pass kernel on bf16 weights + remainder, fp32 moments,
# 15 threads) 3.85 G params/s, CPU fp32 matmul 1.3-1.4 TFLOP/s; the GPU's memory as torch
# reports it. (The same bench measured 742-790 TFLOP/s and 46-49 GB/s duplex there.)
REFERENCE = HardwareProfile(
    name="NVIDIA H200 workstation (measured)", gpu="NVIDIA H200",
    vram_total=150_109_880_320, ram_total=128 * GiB, cpu_cores=16, matmul_tflops=730.0,
    cpu_tflops=1.3, h2d_gbs=55.0, d2h_gbs=55.0, duplex_gbs=48.0, adam_params_per_s=3.85e9,
    disk_read_gbs=1.7, disk_write_gbs=1.5)


def cache_file() -> Path:
    """Where this machine's measured profile is kept (``slideformer/hardware-<host>.json``)."""
    try:
        from platformdirs import user_cache_dir
        root = Path(user_cache_dir("slideformer"))
    except ImportError:  # platformdirs is absent on some headless machines: XDG's default
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slideformer"
    host = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in platform.node() or "local")
    return root / f"hardware-{host}.json"


def save_profile(profile: HardwareProfile, path: Path | None = None) -> Path:
    path = path or cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=2))
    os.replace(tmp, path)
    return path


def read_profile(path: Path) -> HardwareProfile:
    """A profile JSON file, with a clear error for each way it can be wrong."""
    fix = "run `slideformer bench --hardware` to measure this machine again"
    if not path.is_file():
        raise UserError(path, "does not exist", fix)
    try:
        return HardwareProfile.from_dict(read_json(path, fix))
    except (TypeError, ValueError) as e:
        raise UserError(path, f"is not a hardware profile ({e})", fix) from None
