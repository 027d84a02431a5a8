"""The planner's host-memory prediction against the real Trainer on the CPU backend.

Each case runs ``Trainer.setup`` and two training steps in a fresh Python process and measures
how far its resident memory rose above the baseline. The baseline is the process's resident
memory after torch, the engine and the data stand-in are imported and a small warm-up step ran
(so the one-time runtime allocations are not counted), with Python's garbage and malloc's free
pages released (``malloc_trim``). The peak is the kernel's high-water mark of resident memory
(``VmHWM``), reset to the baseline through ``/proc/self/clear_refs``: ``getrusage``'s
``ru_maxrss`` would not do in a child process, since Linux carries the parent's high-water mark
over ``vfork`` + ``exec``. The prediction is ``Plan.peak_rss`` less the runtime baseline the
measurement excludes. The model files are read, never mapped, so none of their pages count in
either (slideformer.engine.models.weights). On the CPU backend the executor's "device" buffers
are host memory too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="needs Linux /proc to measure peak resident memory")

MiB = 1 << 20


# ---- the probe, run as a script in a fresh process ----------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _release() -> None:
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class _Stream:
    """Random micro-batches made at each step, as the data pipeline's BatchStream makes them."""

    def __init__(self, vocab: int, micro_batch: int, seq_len: int, grad_accum: int, packed: bool):
        self.shape, self.n, self.vocab, self.packed = (micro_batch, seq_len), grad_accum, vocab, packed
        self.steps_per_epoch = 1000

    def next_step(self):
        import torch
        from slideformer.engine.data.dataset import MicroBatch
        out = []
        for _ in range(self.n):
            ids = torch.randint(0, self.vocab, self.shape)
            doc = (torch.arange(self.shape[1]) >= self.shape[1] // 2).long().expand(self.shape)
            out.append(MicroBatch(ids, torch.randint(0, self.vocab, self.shape),
                                  doc.clone() if self.packed else None))
        return out

    def state_dict(self) -> dict:
        return {}


def probe(model_dir: str, run_dir: str, overrides: dict) -> dict:
    """Set up the Trainer, run two steps; return the RSS rise and the plan's prediction."""
    import torch

    from slideformer.engine.config import RunConfig, override
    from slideformer.engine.events import StepMetrics
    from slideformer.engine.plan.memory import HOST_RUNTIME
    from slideformer.engine.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = override(RunConfig(), {"model.path": model_dir, "output.run_dir": run_dir,
                                 "train.device": "cpu", "train.max_steps": 10, **overrides})
    t = cfg.train
    spec_vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    stream = _Stream(spec_vocab, t.micro_batch, cfg.data.max_seq_len, t.grad_accum, cfg.data.packing)
    _warm_up()
    _release()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current resident memory
    base = _status("VmRSS")
    trainer = None

    def stop_after_two(ev):
        if isinstance(ev, StepMetrics) and ev.step >= 2:
            trainer.stop(save=False)

    trainer = Trainer(cfg, callbacks=[stop_after_two])
    trainer.setup(data=(None, stream))
    trainer.train()
    measured = _status("VmHWM") - base
    plan = trainer.plan
    trainer.cleanup()
    return {"measured": measured, "predicted": plan.peak_rss - HOST_RUNTIME["cpu"],
            "shape": plan.exec_shape.__dict__, "max_micro_batch": plan.max_micro_batch,
            "disk_layers": plan.disk_layers}


def _warm_up() -> None:
    """Run a tiny layer's forward, recompute+backward and LM head once: the first autograd
    backward alone keeps ~35 MB of runtime state for good, whatever the shapes, and that belongs
    to the runtime baseline, not to this run's buffers."""
    import torch

    from slideformer.engine.kernels.linear_ce import linear_ce_fwd_bwd
    from slideformer.engine.models.layers import decoder_layer, rope_tables
    from slideformer.engine.models.model import positions_for
    from slideformer.engine.models.spec import spec_from_config
    from slideformer.engine.models.tiny import TinyShape, tiny_config
    from slideformer.engine.runtime.executor import SlidingExecutor

    spec = spec_from_config(tiny_config("llama", TinyShape(layers=1, hidden=64, heads=4, kv_heads=2,
                                                           intermediate=96, vocab=128)))
    holder = type("Holder", (), {"spec": spec, "lora": None, "aux": (), "norms": None, "ff_tile": 0,
                                 "fp8": False,
                                 "_norm_views": SlidingExecutor._norm_views})()
    ids = torch.randint(0, 128, (2, 16))
    for dt in (torch.float32, torch.bfloat16):
        w = (0.02 * torch.randn(spec.params_per_layer)).to(dt)
        rope = rope_tables(spec, positions_for(ids, None), dt)
        x = torch.randn(2, 16, 64).to(dt)
        with torch.no_grad():
            decoder_layer(spec, spec.layer_layout.views(w), x, rope)
        SlidingExecutor._layer_backward(holder, w, torch.zeros(w.numel()), x, x, rope, None)
        linear_ce_fwd_bwd(x, torch.randn(128, 64).to(dt), ids, 1.0, 8, torch.zeros(128, 64))


# ---- the tests ------------------------------------------------------------------------------------
def _run_probes(model_dir: Path, tmp_path: Path, cases: list[dict]) -> list[dict]:
    """Run one probe process per case, all at once (each measures only itself)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    procs = []
    for i, over in enumerate(cases):
        args = json.dumps([str(model_dir), str(tmp_path / f"run{i}"), over])
        procs.append(subprocess.Popen([sys.executable, __file__, args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="module")
def rss_model(tmp_path_factory):
    """Hidden 512, 8 layers, vocab 8k: 31.6M parameters, so the state (0.4-0.5 GB) dominates."""
    from slideformer.engine.models.tiny import TinyShape, make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("rss") / "m", "llama",
                           TinyShape(layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1024,
                                     vocab=8192), seed=0)


@pytest.fixture(scope="module")
def head_model(tmp_path_factory):
    """A small body under a 32k-vocab head: each sequence of a micro-batch adds ~150 MB of
    LM-head logits and activations to a 0.2 GB state, so one more sequence is plainly visible."""
    from slideformer.engine.models.tiny import TinyShape, make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("head") / "m", "llama",
                           TinyShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256,
                                     vocab=32768), seed=0)


RSS_CASES = [
    # fp32 compute, GPU-style checkpoints, clipping, packed sequences
    {"data.max_seq_len": 64, "train.micro_batch": 2, "train.grad_accum": 2},
    # host checkpoints, bf16 moments, no clipping, padded sequences
    {"data.max_seq_len": 64, "train.micro_batch": 1, "train.grad_accum": 3,
     "budget.checkpoints": "host", "optim.moments_dtype": "bfloat16", "optim.max_grad_norm": 0.0,
     "data.packing": False},
    # bf16 compute (weights + remainders), 3 slots only, longer sequences
    {"data.max_seq_len": 128, "train.micro_batch": 2, "train.grad_accum": 1,
     "train.compute_dtype": "bfloat16", "budget.slots": 3},
    # 8-bit moments (blocks of codes with their scales), clipping
    {"data.max_seq_len": 64, "train.micro_batch": 2, "train.grad_accum": 2,
     "optim.moments_dtype": "int8"},
]


def test_predicted_host_memory_matches_measured_peak(rss_model, tmp_path):
    results = _run_probes(rss_model, tmp_path, RSS_CASES)
    for case, r in zip(RSS_CASES, results):
        err = (r["predicted"] - r["measured"]) / r["measured"]
        assert abs(err) < 0.10, (f"{case}: predicted {r['predicted'] / MiB:.0f} MiB, measured "
                                 f"{r['measured'] / MiB:.0f} MiB ({err:+.1%})")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """12 layers of 3.9M parameters under a 4k vocab, stored in fp32: 206 MB of safetensors
    for a QLoRA state of about 42 MB (NF4 layers, fp32 embedding and head)."""
    from slideformer.engine.models.tiny import TinyShape, make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "m", "llama",
                           TinyShape(layers=12, hidden=512, heads=8, kv_heads=4, intermediate=2048,
                                     vocab=4096), seed=0)


def test_qlora_base_on_nvme_stays_within_the_predicted_peak(wide_model, tmp_path):
    """QLoRA with a RAM budget that puts part of the base on the NVMe tier, from model files
    larger than all the run may hold above the runtime: the measured peak is the predicted one,
    so no page of the files stays resident (memory-mapped, as they were, every page read stayed
    until the end of the load: 1.9 times the prediction here), and the run keeps within its
    budget."""
    from slideformer.engine.config import RunConfig, override
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.weights import Checkpoint
    from slideformer.engine.plan import REFERENCE, plan_run
    from slideformer.engine.plan.evaluate import DISK_MARGIN
    from slideformer.engine.plan.memory import HOST_RUNTIME

    (tmp_path / "nvme").mkdir()
    run = {"train.method": "qlora", "data.max_seq_len": 64, "train.micro_batch": 2,
           "budget.slots": 2, "budget.checkpoints": "gpu", "budget.nvme_dir": str(tmp_path / "nvme")}
    spec = load_spec(wide_model)

    def planned(ram: int):
        cfg = override(RunConfig(), {**run, "model.path": str(wide_model), "train.device": "cpu",
                                     "budget.ram": str(ram)})
        return plan_run(cfg, spec, device="cpu", hardware=REFERENCE)

    in_ram = planned(64 << 30)
    layer = next(a.bytes for a in in_ram.allocations if a.purpose == "parameter slots") // 2
    # the tier's 3 staging buffers: 5 layers or more go, within the budget less its margin
    budget = int((in_ram.peak_rss - 2 * layer) / (1 - DISK_MARGIN))
    (r,) = _run_probes(wide_model, tmp_path, [{**run, "budget.ram": str(budget)}])
    assert 5 <= r["disk_layers"] < spec.num_layers
    assert Checkpoint(wide_model).size_on_disk() > r["predicted"]
    err = (r["predicted"] - r["measured"]) / r["measured"]
    assert abs(err) < 0.10, (f"predicted {r['predicted'] / MiB:.0f} MiB, measured "
                             f"{r['measured'] / MiB:.0f} MiB ({err:+.1%})")
    # The plan fills the budget to within 2%; the measured peak moves by several MiB from run to
    # run (allocator arenas of the tier's threads: 144-151 MiB here, 157 MiB on a CI machine, for
    # a budget of 147 MiB), which is 5-7% of this tiny run and nothing at a real model's scale.
    # So the budget holds within the prediction's own tolerance; the mapped files (1.9x) would not.
    assert r["measured"] <= 1.10 * (budget - HOST_RUNTIME["cpu"])


def test_largest_micro_batch_agrees_with_running_it(head_model, tmp_path):
    """Budget half-way between the predicted peaks of micro-batch 3 and 4: the planner says 3,
    and the measured peaks (plus the same runtime baseline) fall on either side of it."""
    from slideformer.engine.config import RunConfig, override
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.plan import REFERENCE, plan_run
    from slideformer.engine.plan.memory import HOST_RUNTIME

    spec = load_spec(head_model)
    base = {"data.max_seq_len": 512, "budget.slots": 2, "budget.checkpoints": "gpu"}

    def host_peak(m: int, ram: str = "64GiB"):
        cfg = override(RunConfig(), {**base, "train.micro_batch": m, "train.device": "cpu",
                                     "budget.ram": ram})
        return plan_run(cfg, spec, device="cpu", hardware=REFERENCE)

    p3, p4 = host_peak(3).tier("host").peak, host_peak(4).tier("host").peak
    budget = (p3 + p4) // 2
    assert host_peak(1, str(budget)).max_micro_batch == 3
    # run both with room to spare (the Trainer refuses a run its plan says cannot fit)
    m3, m4 = _run_probes(head_model, tmp_path, [{**base, "train.micro_batch": m, "budget.ram": "64GiB"}
                                                 for m in (3, 4)])
    assert m3["measured"] + HOST_RUNTIME["cpu"] <= budget < m4["measured"] + HOST_RUNTIME["cpu"], (
        f"budget {budget / MiB:.0f} MiB; measured {m3['measured'] / MiB:.0f} and "
        f"{m4['measured'] / MiB:.0f} MiB above a {HOST_RUNTIME['cpu'] / MiB:.0f} MiB runtime")


if __name__ == "__main__":
    model, run, over = json.loads(sys.argv[1])
    print(json.dumps(probe(model, run, over)))
