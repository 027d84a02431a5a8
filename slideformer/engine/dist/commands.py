"""CLI: ``export-distributed`` (a run config as an FSDP2 + torchrun training folder)."""
from __future__ import annotations

from pathlib import Path

from slideformer.engine.train.commands import FLAGS, TYPES, build_config


def register(sub) -> None:
    p = sub.add_parser("export-distributed",
                       help="write a self-contained FSDP2 training script and torchrun command "
                            "for a run config (clusters, several hosts)")
    p.add_argument("--config", help="run TOML file (the same as for train)")
    p.add_argument("--out", required=True, help="new folder for the script, data and command")
    for flag, key in FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), type=TYPES.get(flag, str),
                       help=f"overrides {key}")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key (TOML value syntax)")
    p.set_defaults(func=_export)


def _export(a) -> int:
    from slideformer.engine.dist.export import export_distributed

    def show(ev) -> None:
        if type(ev).__name__ == "Log":
            print(f"{ev.level}: {ev.message}")

    out = export_distributed(build_config(a), Path(a.out), show)
    print(f"wrote {out}\n  one host, N GPUs: NPROC=N sh {out / 'torchrun.sh'}\n"
          f"  several hosts: see the header of {out / 'train_fsdp.py'}")
    return 0
