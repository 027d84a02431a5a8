"""The planner on public model configs, its executor shape, fixes, budgets and CLI (CPU only).

Public configs (tests/fixtures/configs) are the published config.json of each model; a model
folder holding only config.json must plan, since nothing is loaded.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from slideformer.engine import cli
from slideformer.engine.config import BudgetConfig, RunConfig, override
from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan import REFERENCE, load_profile, plan_run
from slideformer.engine.plan.budget import resolve_budgets
from slideformer.engine.plan.evaluate import TIGHT
from slideformer.engine.plan.hardware import read_profile, save_profile
from slideformer.engine.plan.report import format_plan
from slideformer.engine.plan.machine import HostMemory

FIXTURES = Path(__file__).parents[2] / "fixtures" / "configs"
GiB = 1 << 30
# "24 GiB VRAM / 128 GiB RAM / 2 TB NVMe" on the reference machine's speeds
CONSUMER = {"budget.vram": "24GiB", "budget.ram": "128GiB", "budget.nvme_size": "2TB",
            "data.max_seq_len": 2048, "train.micro_batch": 1, "train.grad_accum": 2}


def model_folder(tmp_path: Path, name: str) -> Path:
    """A folder with only the published config.json of ``name``."""
    d = tmp_path / name
    d.mkdir()
    shutil.copy(FIXTURES / f"{name}.json", d / "config.json")
    return d


def consumer_plan(tmp_path: Path, name: str, **extra):
    cfg = override(RunConfig(), {**CONSUMER, "budget.nvme_dir": str(tmp_path), **extra})
    return plan_run(cfg, load_spec(model_folder(tmp_path, name)), hardware=REFERENCE)


@pytest.mark.parametrize("name,params", [("llama-3.1-8b", 8_030_261_248),
                                         ("qwen2.5-72b-instruct", 72_706_203_648),
                                         ("mistral-large-instruct-2407", 122_610_069_504)])
def test_public_configs_count_exactly(tmp_path, name, params):
    plan = consumer_plan(tmp_path, name)
    assert plan.total_params == params
    assert plan.to_dict()["total_params"] == params


def test_llama_8b_fits_the_gpu_but_host_ram_is_tight(tmp_path):
    plan = consumer_plan(tmp_path, "llama-3.1-8b")
    assert plan.device == "cuda" and plan.exec_shape.slots >= 2
    assert plan.tier("gpu").peak <= 24 * GiB
    # 8.03 G params x 16 B (bf16 weights + remainders, fp32 moments, fp32 grads) = 120 GiB of 128
    assert plan.verdict == "tight" and "host RAM" in plan.reason
    names = [f.name for f in plan.fixes]
    assert names[0] == "bf16 moments" and plan.fixes[0].fits and not plan.fixes[0].exact
    # a tight host stays in RAM (a disk layer costs a read and a write per step): tests/engine/runtime/test_nvme_plan.py
    assert plan.disk_layers == 0 and "optimizer state on disk" not in names
    assert plan.max_micro_batch >= 1 and plan.max_global_batch >= 2
    assert plan.speed.bound == "cpu optimizer"  # 8 G params of AdamW vs 2 x 2048 tokens of compute


@pytest.mark.parametrize("name", ["qwen2.5-72b-instruct", "mistral-large-instruct-2407"])
def test_huge_models_do_not_fit_and_say_why(tmp_path, name):
    plan = consumer_plan(tmp_path, name)
    assert plan.verdict == "does not fit"
    assert "GPU memory" in plan.reason and "host RAM" in plan.reason
    within = [f for f in plan.fixes if "train.method" not in dict(f.settings)]
    assert within and not any(f.fits for f in within)  # nothing within full fine-tuning fits
    assert any(f.name == "switch to qlora" and f.fits for f in plan.fixes)
    assert plan.max_micro_batch == 0 and plan.max_global_batch == 0
    # bf16 weights alone exceed 128 GiB: no setting can fix the host, and the plan says so
    assert any(n.startswith("no setting makes host fit") for n in plan.notes)


def test_fixes_that_claim_to_fit_do_fit(tmp_path):
    """Apply each fix's settings to the run config: the re-planned run fits as promised."""
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    cfg = override(RunConfig(), {"budget.vram": "24GiB", "budget.ram": "100GiB",
                                 "data.max_seq_len": 1024, "train.micro_batch": 64,
                                 "budget.checkpoints": "gpu"})
    plan = plan_run(cfg, spec, hardware=REFERENCE)
    assert plan.verdict == "does not fit" and "GPU memory" in plan.reason
    assert any(f.fits for f in plan.fixes)
    for fix in plan.fixes:
        if fix.available:
            fixed = plan_run(override(cfg, dict(fix.settings)), spec, hardware=REFERENCE)
            assert (fixed.verdict != "does not fit") == fix.fits, fix
            assert plan.tier(fix.tier).peak - fixed.tier(fix.tier).peak == fix.saves


def test_largest_batches_are_the_edge_of_fitting(tmp_path):
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    cfg = override(RunConfig(), {"budget.vram": "24GiB", "budget.ram": "100GiB",
                                 "data.max_seq_len": 1024, "train.micro_batch": 8, "train.grad_accum": 2})
    plan = plan_run(cfg, spec, hardware=REFERENCE)
    m = plan.max_micro_batch
    assert m >= 8
    at = lambda **kw: plan_run(override(cfg, kw), spec, hardware=REFERENCE).verdict  # noqa: E731
    assert at(**{"train.micro_batch": m}) != "does not fit"
    assert at(**{"train.micro_batch": m + 1}) == "does not fit"
    n = plan.max_global_batch // 8
    assert at(**{"train.grad_accum": n}) != "does not fit"
    assert at(**{"train.grad_accum": n + 1}) == "does not fit"


def test_exec_shape_takes_as_many_slots_as_fit(tmp_path):
    """Over a sweep of VRAM budgets: the chosen K slots keep the GPU under the 90% line, K + 1
    would cross it, K is within [2, L] and never falls as the budget grows."""
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    base = {"budget.ram": "100GiB", "data.max_seq_len": 1024, "train.micro_batch": 4,
            "budget.checkpoints": "gpu", "budget.gpu_layers": 0}

    def plan(vram: int, slots: int = 0):
        cfg = override(RunConfig(), {**base, "budget.vram": str(vram), "budget.slots": slots})
        return plan_run(cfg, spec, hardware=REFERENCE)

    def gpu_share(p) -> float:
        return p.tier("gpu").peak / p.tier("gpu").budget

    L, chosen = spec.num_layers, []
    for vram in range(6 << 30, 40 << 30, 3 << 30):
        k = plan(vram).exec_shape.slots
        assert 2 <= k <= L
        if k > 2:
            assert gpu_share(plan(vram, k)) <= TIGHT
        if k < L and gpu_share(plan(vram, 2)) <= TIGHT:
            assert gpu_share(plan(vram, k + 1)) > TIGHT
        chosen.append(k)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]
    assert plan(80 << 30).exec_shape.slots == L  # never more than the layers
    tiny = plan(6 << 30)
    assert tiny.exec_shape.slots == 2 and tiny.verdict == "does not fit"  # at least 2


def test_config_overrides_the_planners_choice(tmp_path):
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    cfg = override(RunConfig(), {"budget.vram": "24GiB", "budget.ram": "100GiB", "budget.slots": 3,
                                 "budget.checkpoints": "host", "data.max_seq_len": 512})
    shape = plan_run(cfg, spec, hardware=REFERENCE).exec_shape
    assert (shape.slots, shape.checkpoints, shape.seq_len) == (3, "host", 512)
    auto = plan_run(override(cfg, {"budget.slots": 0, "budget.checkpoints": "auto",
                                   "data.max_seq_len": 4096, "train.grad_accum": 32}), spec,
                    hardware=REFERENCE)
    assert auto.exec_shape.checkpoints == "host"  # 28 layers x 32 x 4096 x 3072 x 2 B = 21 GiB


def test_trainer_runs_the_plans_shape(tiny_model_factory, tmp_path):
    from slideformer.engine.runtime.backend import CpuBackend
    from slideformer.engine.train.trainer import Trainer

    model = tiny_model_factory("llama")
    for extra, want in (({}, None), ({"budget.slots": 3, "budget.checkpoints": "host"}, (3, "host"))):
        cfg = override(RunConfig(), {"model.path": str(model), "train.device": "cpu",
                                     "output.run_dir": str(tmp_path / "run"), **extra})
        trainer = Trainer(cfg)
        trainer.spec, trainer.backend = load_spec(model), CpuBackend()
        shape = trainer.make_plan().exec_shape
        assert shape == plan_run(cfg, trainer.spec, device="cpu").exec_shape == trainer.plan.exec_shape
        if want:
            assert (shape.slots, shape.checkpoints) == want


def test_a_folder_with_only_config_json_plans(tmp_path, capsys):
    folder = model_folder(tmp_path, "llama-3.2-3b")
    rc = cli.main(["plan", "--model", str(folder), "--seq-len", "1024", "--micro-batch", "8",
                   "--grad-accum", "4", "--vram", "24GiB", "--ram", "120GiB", "--gpu", "rtx4090"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("parameter slots", "activation checkpoints", "AdamW moments", "verdict: FITS",
                 "largest micro-batch", "tokens/s, bound by"):
        assert text in out
    rc = cli.main(["plan", "--model", str(folder), "--json", "--vram", "24GiB", "--ram", "120GiB",
                   "--gpu", "rtx4090", "--no-clip", "--moments", "bfloat16"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["total_params"] == 3_212_749_824 and data["moments_dtype"] == "bfloat16"
    assert {"tier", "purpose", "bytes", "detail", "phase"} <= set(data["allocations"][0])
    assert data["speed"]["bound"] in data["speed"]["busy"]


def test_int8_moments_fit_an_8b_full_fine_tune_in_64_gib(tmp_path, capsys):
    """8-bit moments: 256 one-byte codes and an fp32 scale per block of each item, 6.03 B/param
    of host state with the bf16 weights and remainders. Llama-3.1-8B on a 24 GB GPU with 64 GiB
    of RAM: 100 GiB with fp32 moments, within the budget with int8 ones."""
    folder = model_folder(tmp_path, "llama-3.1-8b")
    args = ["plan", "--model", str(folder), "--gpu", "rtx4090", "--ram", "64GiB", "--json"]
    assert cli.main(args) == 0
    fp32 = json.loads(capsys.readouterr().out)
    assert fp32["verdict"] == "does not fit" and fp32["fixes"][0]["name"] == "int8 moments"
    assert cli.main(args + ["--moments", "int8"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["moments_dtype"] == "int8" and plan["verdict"] in ("fits", "tight")
    assert plan["peak_rss"] <= 64 * GiB
    moments = next(a["bytes"] for a in plan["allocations"] if a["purpose"] == "AdamW moments m, v")
    assert moments == 2 * 8_030_261_248 // 256 * 260  # every item a whole number of blocks here


@pytest.mark.parametrize("args,message", [
    (["--vram", "24XB"], "cannot read '24XB' as a size"),
    (["--vram", "-3GiB"], "is negative"),
    (["--ram", "0"], "is not a positive size"),
    (["--vram", "200GiB"], "is more than the GPU"),
    (["--disk", "{tmp}/missing:2TB"], "is not a folder"),
    (["--micro-batch", "0"], "train.micro_batch"),
])
def test_bad_budgets_are_one_clear_error(tmp_path, capsys, args, message):
    folder = model_folder(tmp_path, "llama-3.2-3b")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    rc = cli.main(["plan", "--model", str(folder), "--gpu", "rtx4090", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "fix:" in err and "Traceback" not in err
    assert err.count("error:") == 1


def test_auto_budgets_leave_a_margin():
    host = HostMemory(total=64 * GiB, available=40 * GiB, own=2 * GiB)
    b = resolve_budgets(BudgetConfig(), "cuda", REFERENCE, None, host)
    assert b.ram == 42 * GiB - int(0.03 * 64 * GiB)  # 3% of 64 GiB > 1 GiB
    assert 0 < REFERENCE.vram_total - b.vram == int(0.03 * REFERENCE.vram_total)
    assert resolve_budgets(BudgetConfig(), "cpu", REFERENCE, None, host).vram is None
    with pytest.raises(UserError, match="fewer|nothing"):
        resolve_budgets(BudgetConfig(ram="auto"), "cpu", REFERENCE, None,
                        HostMemory(total=4 * GiB, available=GiB, own=0))


def test_profiles_are_cached_and_read_back(tmp_path):
    mine = replace(REFERENCE, name="test box", adam_params_per_s=1.0e9, measured=("adam_params_per_s",))
    path = save_profile(mine, tmp_path / "hw.json")
    assert load_profile(str(path)) == mine
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="bad.json: is not valid JSON"):
        read_profile(tmp_path / "bad.json")


def test_bench_measures_this_cpu(tmp_path):
    from slideformer.engine.plan import bench
    assert bench.cpu_matmul_tflops(256) > 0
    assert bench.adam_params_per_s(1 << 18) > 0
    read, write = bench.disk_gbs(tmp_path, 8 << 20)
    assert read > 0 and write > 0 and not list(tmp_path.iterdir())  # the probe file is gone


def test_speed_amortises_the_optimizer_over_accumulation(tmp_path):
    """More micro-batches per step share one pass of PCIe and AdamW: tokens/s rise until the GPU
    bounds the step."""
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    speeds = []
    for n in (1, 4, 16):
        cfg = override(RunConfig(), {"budget.vram": "80GiB", "budget.ram": "100GiB",
                                     "data.max_seq_len": 1024, "train.micro_batch": 8,
                                     "train.grad_accum": n, "budget.gpu_layers": 0})
        speeds.append(plan_run(cfg, spec, hardware=REFERENCE).speed)
    assert speeds[0].tokens_per_s < speeds[1].tokens_per_s < speeds[2].tokens_per_s
    assert speeds[0].bound == "cpu optimizer" and speeds[2].bound == "gpu compute"


def test_spare_vram_goes_to_the_device_optimizer(tmp_path):
    """With VRAM to spare the embedding, head and first layers are updated on the GPU: all of
    them on a large card, some on a 24 GiB one, none when VRAM is short or on the CPU backend."""
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    base = {"budget.ram": "100GiB", "data.max_seq_len": 1024, "train.micro_batch": 8}
    plan = lambda vram, **kw: plan_run(override(RunConfig(), {**base, "budget.vram": vram, **kw}),  # noqa: E731
                                       spec, device="cuda", hardware=REFERENCE)
    big = plan("120GiB")
    assert big.exec_shape.device_update and big.exec_shape.device_layers == spec.num_layers
    assert big.speed.tokens_per_s > plan("120GiB", **{"budget.gpu_layers": 0}).speed.tokens_per_s
    card = plan("24GiB")
    assert card.exec_shape.device_update and 0 < card.exec_shape.device_layers < spec.num_layers
    assert card.tier("gpu").peak <= 0.9 * card.tier("gpu").budget
    assert card.verdict == "fits"
    off = plan("24GiB", **{"budget.gpu_layers": 0})
    assert not off.exec_shape.device_update and off.exec_shape.device_layers == 0
    rows = lambda p: {a.purpose: a.bytes for a in p.allocations if a.tier == "host"}  # noqa: E731
    on, host_only = rows(card), rows(off)
    for what in ("bfloat16 weights", "weight remainders", "AdamW moments m, v"):
        assert on[what] == host_only[what]  # the host copies are kept either way (checkpoints)
    shape = card.exec_shape  # their gradients stay on the device
    on_device = spec.embed_layout.numel + spec.head_layout.numel + shape.device_layers * spec.params_per_layer
    assert on["gradient buffers"] == host_only["gradient buffers"] - 4 * on_device
    assert plan("24GiB", **{"budget.gpu_layers": 3}).exec_shape.device_layers == 3
    short = plan("24GiB", **{"train.micro_batch": 28, "budget.checkpoints": "gpu"})
    assert short.exec_shape.device_layers == 0
    cpu = plan_run(override(RunConfig(), {**base, "budget.vram": "120GiB"}), spec, device="cpu",
                   hardware=REFERENCE)
    assert not cpu.exec_shape.device_update



def test_bf16_residual_stream_is_offered_and_saves_the_checkpoints_half(tmp_path):
    """train.precision autocast keeps fp32 checkpoints; over budget, bf16 is a (numerics-
    changing) fix that saves half of the host checkpoints."""
    spec = load_spec(model_folder(tmp_path, "llama-3.1-8b"))
    extra = {**CONSUMER, "budget.nvme_dir": str(tmp_path), "train.micro_batch": 8, "train.grad_accum": 16,
             "budget.checkpoints": "host"}
    plan = lambda **kw: plan_run(override(RunConfig(), {**extra, **kw}), spec, hardware=REFERENCE)  # noqa: E731
    wide, narrow = plan(**{"train.precision": "autocast"}), plan(**{"train.precision": "bf16"})
    ck = lambda p: sum(a.bytes for a in p.allocations if a.purpose == "pinned activation checkpoints")  # noqa: E731
    assert ck(wide) == 2 * ck(narrow) > 0
    fix = next(f for f in wide.fixes if f.name == "bf16 residual stream")
    assert dict(fix.settings) == {"train.precision": "bf16"} and not fix.exact
    assert fix.saves > 0
    assert not any(f.name == "bf16 residual stream" for f in narrow.fixes)


def test_a_long_sequence_plans_its_layers_in_tiles(tmp_path, monkeypatch):
    """One 64K-token sequence of the 3B: the plan runs each layer in tiles of MIN_TILE tokens
    (its queries too: plain causal rows) and counts a tile's activations, not the sequence's;
    micro-batches of at most FF_TILE tokens, a router loss or LoRA dropout keep it whole
    (runtime.shapes.ff_tile); many rows get TILE_ROWS positions of each a tile, up to FF_TILE."""
    from types import SimpleNamespace

    from slideformer.engine.runtime.shapes import FF_TILE, MIN_TILE, TILE_ROWS, ff_tile
    spec = load_spec(model_folder(tmp_path, "llama-3.2-3b"))
    cfg = override(RunConfig(), {"budget.vram": "24GiB", "budget.ram": "100GiB",
                                 "data.max_seq_len": 65536, "train.micro_batch": 1,
                                 "data.packing": False})
    plan = plan_run(cfg, spec, hardware=REFERENCE)
    assert plan.exec_shape.ff_tokens == MIN_TILE

    def recompute(p):
        return next(a.bytes for a in p.allocations if a.purpose == "recompute activations")
    assert plan_run(override(cfg, {"data.max_seq_len": FF_TILE}), spec,
                    hardware=REFERENCE).exec_shape.ff_tokens == 0
    from slideformer.engine.plan import evaluate
    monkeypatch.setattr(evaluate, "ff_tile", lambda *a, **k: 0)
    whole = plan_run(cfg, spec, hardware=REFERENCE)  # the same sequence untiled
    # a layer's activations are mostly one tile's (on the PyTorch ops the input norm's
    # backward, whole, is the larger moment at 64K)
    assert recompute(plan) < 0.6 * recompute(whole)
    moe = SimpleNamespace(moe=SimpleNamespace(aux_coef=0.001))
    assert ff_tile(moe, 65536) == 0 and ff_tile(spec, 65536, lora_dropout=0.05) == 0
    assert ff_tile(spec, FF_TILE) == 0 and ff_tile(spec, FF_TILE + 1) == MIN_TILE
    assert ff_tile(spec, 16 * 2048, rows=16) == 16 * TILE_ROWS
    assert ff_tile(spec, 64 * 1024, rows=64) == FF_TILE


def test_fp8_precision_plans_faster_projections_and_their_operand_copies(tmp_path):
    """train.precision = "fp8": the plan counts the row-wise copies of a projection's operands
    (kernels.fp8) in the forward and the backward, and a faster step where the projections
    bound it (an 8B QLoRA: GPU-bound)."""
    spec = load_spec(model_folder(tmp_path, "llama-3.1-8b"))
    cfg = override(RunConfig(), {"budget.vram": "24GiB", "budget.ram": "100GiB",
                                 "data.max_seq_len": 1024, "train.micro_batch": 4,
                                 "train.grad_accum": 4, "train.method": "qlora"})
    bf16 = plan_run(cfg, spec, hardware=REFERENCE)
    f8 = plan_run(override(cfg, {"train.precision": "fp8"}), spec, hardware=REFERENCE)
    copies = [a for a in f8.allocations if a.purpose.startswith("FP8 operand copies")]
    assert [a.phase for a in copies] == ["forward", "backward"]
    assert not any(a.purpose.startswith("FP8") for a in bf16.allocations)
    # the down projection's input (4 x 1024 tokens x 14,336) and its matrix, e4m3: 1 byte each
    assert copies[0].bytes == 4 * 1024 * 14336 + 14336 * 4096
    assert bf16.speed.bound == "gpu compute"
    # FP8_SPEEDUP (1.1x, measured) on the MLP's forward, recompute and dL/dx products only
    assert 1.01 < f8.speed.tokens_per_s / bf16.speed.tokens_per_s < 1.1
    assert "FP8" in f8.compute_dtype


def test_fp8_copies_count_the_dense_mlp_only(tiny_model_factory):
    """The e4m3 copies are those of the dense MLP's operands (what runs in FP8): none for a
    model of experts only, the dense MLP's (not the experts') beside Gemma 4's experts."""
    from slideformer.engine.plan.transients import fp8_operands
    assert fp8_operands(load_spec(tiny_model_factory("qwen3_moe")), 512) == []
    g4 = load_spec(tiny_model_factory("gemma4_text", extra_config={"enable_moe_block": True}))
    H, I = g4.hidden_size, g4.intermediate_size
    assert [a.bytes for a in fp8_operands(g4, 512)] == [512 * max(H, I) + I * H] * 2


def test_short_host_ram_keeps_the_top_layers_checkpoints_on_the_gpu(tmp_path):
    """An 8B full fine-tune at 64K tokens a step with 8-bit moments in 64 GiB of RAM: with every
    layer's gradient regenerated the host still needs 69 GiB; the plan keeps the fewest top
    layers' checkpoints on the GPU that bring it inside, and none when RAM is ample."""
    spec = load_spec(model_folder(tmp_path, "llama-3.1-8b"))
    cfg = override(RunConfig(), {"budget.vram": "24GiB", "budget.ram": "64GiB",
                                 "data.max_seq_len": 1024, "train.micro_batch": 8,
                                 "train.grad_accum": 8, "optim.moments_dtype": "int8",
                                 "budget.checkpoints": "host"})
    plan = plan_run(cfg, spec, hardware=REFERENCE)
    s, host, gpu = plan.exec_shape, plan.tier("host"), plan.tier("gpu")
    assert s.regen_layers == spec.num_layers and 0 < s.gpu_checkpoints < spec.num_layers
    assert host.peak <= host.budget and gpu.peak <= gpu.budget
    layer = 8 * 8 * 1024 * spec.hidden_size * 2  # one layer's checkpoints: 8 micro-batches, bf16
    ck = {a.purpose: a.bytes for a in plan.allocations if "checkpoints" in a.purpose}
    assert ck == {"pinned activation checkpoints": (spec.num_layers - s.gpu_checkpoints) * layer,
                  "activation checkpoints": s.gpu_checkpoints * layer}
    assert host.peak + layer > host.budget  # the fewest: one layer more on the host is over
    assert f"those of the top {s.gpu_checkpoints} layers on the GPU" in format_plan(plan)
    ample = plan_run(override(cfg, {"budget.ram": "120GiB"}), spec, hardware=REFERENCE)
    assert ample.exec_shape.gpu_checkpoints == 0
