"""CLI: ``slideformer plan`` (memory and speed before anything loads) and ``bench --hardware``."""
from __future__ import annotations

import json
import re
from pathlib import Path

from slideformer.engine import config as config_mod
from slideformer.engine.config import RunConfig, parse_bytes
from slideformer.engine.errors import UserError
from slideformer.engine.plan.targets import PRESETS
from slideformer.engine.validate import validate


def register(sub) -> None:
    p = sub.add_parser("plan", help="predict memory, largest batch and speed of a run "
                                    "(reads only config.json)")
    p.add_argument("--model", help="model folder (only its config.json is read); "
                                   "default: model.path of --config")
    p.add_argument("--config", help="run .toml file; the flags below override it")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (data.max_seq_len)")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    p.add_argument("--vram", help="GPU memory budget, e.g. 24GiB "
                                  "(default: the GPU's free memory less a margin)")
    p.add_argument("--ram", help="host memory budget, e.g. 128GiB "
                                 "(default: available RAM less a margin)")
    p.add_argument("--disk", metavar="PATH[:SIZE]", help="NVMe tier folder and budget, e.g. /nvme:2TB")
    p.add_argument("--method", choices=config_mod.METHODS,
                   help="full fine-tuning, or LoRA / QLoRA adapters over a frozen base")
    p.add_argument("--rank", type=int, help="LoRA rank (lora.rank)")
    p.add_argument("--moments", choices=("float32", "bfloat16", "int8"),
                   help="AdamW moment precision (int8: 8-bit blocks, not exact)")
    p.add_argument("--precision", choices=("bf16", "autocast", "fp8"),
                   help="train.precision (fp8: row-wise FP8 projections, GPUs with FP8 only)")
    p.add_argument("--checkpoints", choices=("auto", "gpu", "host"),
                   help="activation checkpoint placement")
    p.add_argument("--slots", type=int, help="parameter slots on the GPU (0: the planner's choice)")
    p.add_argument("--no-clip", action="store_true",
                   help="no gradient clipping (updates overlap the backward)")
    p.add_argument("--clip-regen", metavar="N|auto",
                   help="with clipping: lowest layers whose gradient a second backward "
                        "regenerates (train.clip_regen; auto: as many as host RAM needs)")
    p.add_argument("--no-packing", action="store_true", help="pad sequences instead of packing them")
    p.add_argument("--compute-dtype", choices=("auto", "bfloat16", "float32"))
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N (train.device)")
    p.add_argument("--gpu", default="this", metavar="NAME",
                   help="the machine to plan for: this (this machine: its `bench --hardware` "
                        "profile, else what can be seen of it) or a GPU: " + ", ".join(PRESETS)
                        + "; --ram and --disk give the host it sits in")
    p.add_argument("--hardware", metavar="FILE",
                   help="plan with a profile file (`bench --hardware --json` of another machine)")
    p.add_argument("--gpus", type=int, help="GPUs of one host sharing the run (train.gpus): the "
                                         "plan of each GPU, the shared host RAM and the speed")
    p.add_argument("--suggest", action="store_true",
                   help="choose known-good first settings for this model and machine (method, "
                        "rank, lr, sequence length, batch), print them as run-config tables with "
                        "the reason for each, and plan them")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_plan)
    # argparse takes "-3GiB" for an option; let it through to the budget check's clear error.
    p._negative_number_matcher = re.compile(r"^-\d+(\.\d*)?[A-Za-z]*$")

    b = sub.add_parser("bench", help="measure this machine for the planner (--hardware)")
    b.add_argument("--hardware", action="store_true",
                   help="GPU matmul, PCIe, CPU AdamW and disk, in under a minute")
    b.add_argument("--disk-dir", help="folder whose disk to measure (default: the cache folder)")
    b.add_argument("--json", action="store_true", help="print the profile as JSON")
    b.set_defaults(func=_bench)


def split_disk(text: str) -> tuple[str, str]:
    """``PATH:SIZE`` or ``PATH`` -> (path, size); a colon inside a Windows path stays in the path."""
    path, sep, size = text.rpartition(":")
    if sep and path and size:
        try:
            parse_bytes(size)
            return path, size
        except UserError:
            pass
    return text, "auto"


def config_from_args(a) -> RunConfig:
    """The run config of ``plan``'s arguments: --config, then each flag given."""
    cfg = config_mod.load(a.config) if a.config else RunConfig()
    given = {"model.path": a.model, "data.max_seq_len": a.seq_len, "train.micro_batch": a.micro_batch,
             "train.grad_accum": a.grad_accum, "budget.vram": a.vram, "budget.ram": a.ram,
             "optim.moments_dtype": a.moments, "budget.checkpoints": a.checkpoints,
             "budget.slots": a.slots, "train.compute_dtype": a.compute_dtype, "train.device": a.device,
             "train.method": a.method, "lora.rank": a.rank, "train.gpus": a.gpus,
             "train.precision": a.precision}
    if a.no_clip:
        given["optim.max_grad_norm"] = 0.0
    if a.clip_regen is not None:
        given["train.clip_regen"] = int(a.clip_regen) if a.clip_regen.isdigit() else a.clip_regen
    if a.no_packing:
        given["data.packing"] = False
    if a.disk:
        given["budget.nvme_dir"], given["budget.nvme_size"] = split_disk(a.disk)
    return validate(config_mod.override(cfg, {k: v for k, v in given.items() if v is not None}),
                    "plan")


def _plan(a) -> int:
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.plan.planner import plan_run
    from slideformer.engine.plan.report import format_plan

    cfg = config_from_args(a)
    hardware = a.hardware or a.gpu
    if cfg.train.gpus not in (1, "all"):
        from slideformer.engine.dist.plan import format_gpus, plan_gpus
        multi = plan_gpus(cfg, load_spec(cfg.model.path), cfg.train.gpus, hardware)
        print(json.dumps(multi.to_dict(), indent=2, default=str) if a.json else
              format_plan(multi.per_gpu) + "\n\n" + format_gpus(multi))
        return 0
    spec = load_spec(cfg.model.path)
    if a.suggest:
        return _suggest(cfg, spec, hardware, a.json)
    plan = plan_run(cfg, spec, hardware=hardware)
    print(json.dumps(plan.to_dict(), indent=2, default=str) if a.json else format_plan(plan))
    return 0


def _suggest(cfg: RunConfig, spec, hardware: str, as_json: bool) -> int:
    from slideformer.engine.plan.planner import plan_run
    from slideformer.engine.plan.report import format_plan
    from slideformer.engine.plan.suggest import suggest

    s = suggest(cfg, spec, hardware)
    plan = plan_run(config_mod.override(cfg, s.values), spec, hardware=hardware)
    if as_json:
        print(json.dumps({"settings": s.values, "reasons": list(s.reasons),
                          "plan": plan.to_dict()}, indent=2, default=str))
        return 0
    print("suggested settings:\n" + "\n".join(f"  - {r}" for r in s.reasons) + "\n")
    print(config_mod.dumps_tables(s.tables()))
    print(format_plan(plan))
    return 0


def _bench(a) -> int:
    from slideformer.engine.plan.bench import measure
    from slideformer.engine.plan.hardware import cache_file, save_profile

    if not a.hardware:
        raise UserError("bench", "needs --hardware", "run `slideformer bench --hardware`")
    path = cache_file()
    folder = Path(a.disk_dir) if a.disk_dir else path.parent
    if not folder.is_dir():
        if a.disk_dir:
            raise UserError(folder, "is not a folder", "give an existing folder with --disk-dir")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(folder, f"cannot be created for the hardware profile ({e.strerror})",
                            "remove the file that stands there, or set XDG_CACHE_HOME to "
                            "another folder") from None
    print("measuring this machine for the planner:")
    profile = measure(folder)
    for note in profile.notes:
        print(f"  note: {note}")
    print(f"saved to {save_profile(profile, path)}")
    if a.json:
        print(json.dumps(profile.to_dict(), indent=2))
    return 0
