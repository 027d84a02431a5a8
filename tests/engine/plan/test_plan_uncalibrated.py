"""A machine nothing was measured on: its profile from the facts NVML and psutil give.

``targets.uncalibrated`` turns NVML's GPU name, memory and PCIe link, the RAM and the CPU cores
into a hardware profile; these tests hand it fake facts (no GPU needed), and one of them a fake
``pynvml`` module, so the path from NVML to the plan runs here as on a GPU machine. The 70B
QLoRA case is the run measured on the reference H200 (benchmarks/RESULTS.md: 1,337 tok/s, peak
RSS 119.3 GiB) that the planner once called "does not fit" at 35.6 tok/s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from slideformer.engine.config import RunConfig, override
from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.plan import machine, planner, targets
from slideformer.engine.plan.hardware import read_profile, save_profile
from slideformer.engine.plan.machine import GpuMemory, HostMemory
from slideformer.engine.plan.report import format_plan
from slideformer.engine.plan.targets import (ADAM_CORES, ADAM_PER_CORE, CONSERVATIVE, LANE_GBS,
                                             MATMUL_SHARE, PCIE_SHARE, PRESETS, UNCALIBRATED,
                                             known_gpu, uncalibrated)

GiB = 1 << 30
CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
H200 = GpuMemory("NVIDIA H200", 150_109_880_320, 149_000_000_000, 0, pcie_gen=5, pcie_width=16)
RAM = 135_128_870_912
"""The reference H200 machine's MemTotal (125.8 GiB; tests/fixtures/hardware/h200.json)."""


def test_an_h200_takes_its_model_s_rate_and_the_link_nvml_reports():
    p = uncalibrated(H200, RAM, 16)
    assert p.matmul_tflops == pytest.approx(989.0 * MATMUL_SHARE)
    assert p.h2d_gbs == pytest.approx(LANE_GBS[5] * 16 * PCIE_SHARE) and 54 < p.h2d_gbs < 56
    assert p.adam_params_per_s == pytest.approx(16 * ADAM_PER_CORE)
    assert p.vram_total == H200.total and p.ram_total == RAM and p.cpu_cores == 16
    assert p.name == "this machine (NVIDIA H200, not measured)" and UNCALIBRATED in p.notes
    assert p.source("matmul_tflops").startswith("from the GPU model (NVIDIA H200: 989")
    assert p.source("h2d_gbs").startswith("from the link NVML reports (PCIe 5.0 x16")
    assert p.source("disk_read_gbs").startswith("default")


def test_an_rtx4090_in_an_x8_slot_gets_the_slot_s_link():
    card = GpuMemory("NVIDIA GeForce RTX 4090", 24 * GiB, 23 * GiB, 0, pcie_gen=4, pcie_width=16)
    full = uncalibrated(card, 64 * GiB, 8)
    assert full.matmul_tflops == pytest.approx(165.2 * MATMUL_SHARE)
    assert full.h2d_gbs == pytest.approx(LANE_GBS[4] * 16 * PCIE_SHARE)
    assert full.adam_params_per_s == pytest.approx(8 * ADAM_PER_CORE)
    half = uncalibrated(GpuMemory(card.name, card.total, card.free, 0, 4, 8), 64 * GiB, 8)
    assert half.h2d_gbs == pytest.approx(full.h2d_gbs / 2)
    assert half.duplex_gbs == pytest.approx(full.duplex_gbs / 2)
    unknown_link = uncalibrated(GpuMemory(card.name, card.total, card.free, 0), 64 * GiB, 8)
    assert unknown_link.h2d_gbs == pytest.approx(full.h2d_gbs)  # the 4090's own PCIe 4.0 x16
    assert unknown_link.source("h2d_gbs").startswith("from the GPU model's link")


def test_an_unknown_gpu_is_a_conservative_default_that_says_so():
    p = uncalibrated(GpuMemory("NVIDIA Quux 9000", 32 * GiB, 31 * GiB, 0), 32 * GiB, 4)
    slowest = min(PRESETS.values(), key=lambda g: g.bf16_tflops)
    assert CONSERVATIVE == slowest.key
    assert p.matmul_tflops == pytest.approx(slowest.bf16_tflops * MATMUL_SHARE)
    assert p.vram_total == 32 * GiB and p.gpu == "NVIDIA Quux 9000"
    assert UNCALIBRATED in p.notes and "uncalibrated: run `slideformer bench --hardware`" in UNCALIBRATED
    assert any("NVIDIA Quux 9000 is not a GPU the planner knows" in n for n in p.notes)
    assert p.source("matmul_tflops").startswith("default: NVIDIA Quux 9000 is not a GPU")


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200nvl"), ("NVIDIA H100 PCIe", "h100pcie"),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100pcie"), ("NVIDIA L40S", "l40s"),
    ("GeForce RTX 4090", "rtx4090"),  # older drivers leave out "NVIDIA"
    ("nvidia geforce  rtx 3090", "rtx3090"), ("NVIDIA RTX A6000", "rtxa6000"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None),  # a laptop part is not the desktop card
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA H20", None)])
def test_gpus_are_known_by_the_names_nvml_gives(name, key):
    found = known_gpu(name)
    assert (found.key if found else None) == key


def test_cpu_adamw_scales_with_cores_up_to_the_measured_count():
    rates = [uncalibrated(None, 64 * GiB, n).adam_params_per_s for n in (2, ADAM_CORES, 64)]
    assert rates == pytest.approx([2 * ADAM_PER_CORE, ADAM_CORES * ADAM_PER_CORE,
                                   ADAM_CORES * ADAM_PER_CORE])
    assert f"{ADAM_CORES} cores at most" in uncalibrated(None, 64 * GiB, 64).source("adam_params_per_s")
    fallback = uncalibrated(None, 64 * GiB, 4).without_native_adam("no C compiler")
    assert fallback.adam_params_per_s < 4 * ADAM_PER_CORE
    assert "PyTorch fallback" in fallback.source("adam_params_per_s")


class _FakeNvml:
    """The pynvml calls machine.gpu_memory makes, answering for one H200; ``link`` False: the
    link queries are not supported (as under some vGPUs)."""

    def __init__(self, link: bool = True):
        self.link = link

    def nvmlInit(self): pass  # noqa: E704
    def nvmlShutdown(self): pass  # noqa: E704
    def nvmlDeviceGetHandleByIndex(self, i): return i  # noqa: E704
    def nvmlDeviceGetName(self, h): return b"NVIDIA H200"  # noqa: E704
    def nvmlDeviceGetComputeRunningProcesses(self, h): return []  # noqa: E704

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=H200.total, free=H200.free)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._link(5)

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._link(16)

    def _link(self, value: int) -> int:
        if not self.link:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return value


@pytest.mark.parametrize("link", [True, False])
def test_detected_reads_nvml_and_psutil(monkeypatch, link):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(link))
    gpu = machine.gpu_memory()
    assert (gpu.name, gpu.total, gpu.pcie_gen, gpu.pcie_width) == (
        "NVIDIA H200", H200.total, 5 if link else None, 16 if link else None)
    p = targets.detected()
    assert p.gpu == "NVIDIA H200" and p.matmul_tflops == pytest.approx(989.0 * MATMUL_SHARE)
    assert p.source("h2d_gbs").startswith("from the link NVML" if link else "from the GPU model's")
    assert p.cpu_cores == machine.cpu_cores() >= 1


def test_sources_are_kept_in_the_cached_profile(tmp_path):
    p = uncalibrated(H200, RAM, 16)
    assert read_profile(save_profile(p, tmp_path / "hw.json")) == p
    bad = dict(json.loads((tmp_path / "hw.json").read_text()), sources=[["matmul_tflops"]])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="'sources' is"):
        read_profile(tmp_path / "bad.json")


def test_the_cgroup_s_inactive_file_cache_counts_as_available(tmp_path, monkeypatch):
    """Reading a model's files fills the container's page cache; the kernel reclaims its
    inactive part before it kills anything, so that part is not the run's to lose."""
    (tmp_path / "memory.max").write_text(f"{8 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{7 * GiB}\n")
    (tmp_path / "memory.stat").write_text(f"anon {GiB}\nfile {6 * GiB}\ninactive_file {5 * GiB}\n")
    monkeypatch.setattr(machine, "CGROUP", str(tmp_path))
    assert machine.cgroup_usage() == 2 * GiB


@pytest.fixture
def reference_h200(monkeypatch, tmp_path):
    """This machine is the reference H200 as NVML and psutil report it, nothing measured, and
    its GPU takes the Triton kernels the measured runs took."""
    host = HostMemory(RAM, RAM - 2 * GiB, GiB // 2)
    monkeypatch.setattr(targets, "gpu_memory", lambda: H200)
    monkeypatch.setattr(planner, "gpu_memory", lambda: H200)
    monkeypatch.setattr(targets, "host_memory", lambda: host)
    monkeypatch.setattr(planner, "host_memory", lambda: host)
    monkeypatch.setattr(targets, "cpu_cores", lambda: 16)
    monkeypatch.setattr(targets, "cache_file", lambda: tmp_path / "none.json")
    monkeypatch.setattr("slideformer.engine.kernels.dispatch.fused_ops_on", lambda d: d == "cuda")


def test_the_70b_qlora_run_is_planned_near_what_it_did(reference_h200):
    """lora_bench.py --table 70b (8 x 1024 x 8 tokens, 24 GiB cap) ran at 1,337 tok/s with a
    peak RSS of 119.3 GiB: the uncalibrated plan is within 20% of that speed and does not call
    it "does not fit"."""
    spec = spec_from_config(json.loads((CONFIGS / "llama-3.1-70b.json").read_text()))
    cfg = override(RunConfig(), {"train.method": "qlora", "train.micro_batch": 8,
                                 "train.grad_accum": 8, "data.max_seq_len": 1024,
                                 "data.packing": False, "budget.vram": "24GiB",
                                 "train.device": "cuda"})
    plan = planner.plan_run(cfg, spec, device="cuda")
    assert abs(plan.speed.tokens_per_s / 1337 - 1) < 0.2, plan.speed.tokens_per_s
    assert plan.verdict != "does not fit", plan.reason
    assert plan.tier("host").peak > 110 * GiB  # the run's host RAM is what is being judged
    text = format_plan(plan)
    assert f"GPU bf16 matmul {989 * MATMUL_SHARE:.0f} TFLOP/s: from the GPU model (NVIDIA H200" in text
    assert "from the link NVML reports (PCIe 5.0 x16" in text and UNCALIBRATED in text
