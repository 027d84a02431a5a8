"""CLI: ``make-tiny-model``, ``info`` (model summary and validation) and ``models`` (the
models already on this machine, :mod:`slideformer.engine.models.discover`)."""
from __future__ import annotations

import json
from pathlib import Path

from slideformer.engine.models.spec import SUPPORTED, load_spec

_SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")
"""make-tiny-model flags that set a TinyShape field of the same name (default: TinyShape's)."""


def register(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="create a tiny random model folder (demo/tests)")
    p.add_argument("--arch", choices=SUPPORTED, default="llama")
    p.add_argument("--out", required=True, help="folder to create")
    for name in _SHAPE_FLAGS:  # the defaults live in TinyShape, imported when the command runs
        p.add_argument("--" + name.replace("_", "-"), type=int, help="default: the demo model's")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser("info", help="validate a model folder and print its architecture")
    p.add_argument("model", help="Hugging Face model folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_info)

    p = sub.add_parser("models", help="list the models already on this machine (Hugging Face "
                                      "cache, Ollama, LM Studio) and what training each fits")
    p.add_argument("--folder", action="append", default=[], metavar="DIR",
                   help="also search DIR (a model folder, or searched 2 levels deep); repeatable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_models)


def _make_tiny(a) -> int:
    from slideformer.engine.errors import UserError
    from slideformer.engine.models.tiny import TinyShape, make_tiny_model
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(out, "exists and is not empty", "choose a new folder for --out")
    sizes = {name: getattr(a, name) for name in _SHAPE_FLAGS if getattr(a, name) is not None}
    shape = TinyShape(**sizes, head_dim=a.head_dim, tie=a.tie)
    make_tiny_model(out, a.arch, shape, a.seed)
    spec = load_spec(out)
    print(f"created {out} ({a.arch}, {spec.num_layers} layers, {spec.num_params:,} parameters)")
    return 0


CONFIG_ONLY = ("this folder has a config.json but no weights (*.safetensors) yet: it can be "
               "planned, not trained; download the weights into it to train")


def model_report(model_dir: Path | str, config_only: bool = False) -> dict:
    """Validate a model folder (config, weights headers, tokenizer) and summarise it.

    Args:
        config_only: accept a folder with only config.json (the weights not downloaded yet):
            the report then says so in ``config_only``, and has no weights, size or template.
    """
    from slideformer.engine.models.tokenizer import load_tokenizer
    from slideformer.engine.models.weights import Checkpoint

    spec = load_spec(model_dir)
    if config_only and not any(Path(model_dir).glob("*.safetensors")):
        return dict(spec.summary(), weights_dtype=None, size_on_disk=None, chat_template=None,
                    config_only=CONFIG_ONLY)
    ckpt = Checkpoint(model_dir)
    ckpt.check(spec)
    tok = load_tokenizer(model_dir)
    out = spec.summary()
    out.update(weights_dtype=ckpt.dtype(), size_on_disk=ckpt.size_on_disk(),
               chat_template=tok.chat_template is not None, config_only="")
    return out


def _info(a) -> int:
    report = model_report(a.model)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        shown = {k: v for k, v in report.items()
                 if v is not None and not (k == "config_only" and not v)}
        width = max(map(len, shown))
        for k, v in shown.items():
            v = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else v
            print(f"{k:>{width}}: {v}")
    return 0


def format_count(n: int) -> str:
    """A count for people: 357216 -> "357.2 K", 8030261248 -> "8.03 B"."""
    for div, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if abs(n) >= div:
            return f"{n / div:.{digits}f} {suffix}"
    return str(n)


_COLUMNS = ("NAME", "SOURCE", "FAMILY", "PARAMS", "ACTIVE", "TYPE", "SIZE", "FULL", "LORA",
            "QLORA", "NOTE")


def _cells(row) -> tuple[str, ...]:
    from slideformer.engine.config import format_bytes
    count = lambda n: "—" if n is None else format_count(n)  # noqa: E731
    fits = [f.verdict or "no plan" for f in row.fits] or ["—"] * 3
    note = ("not supported, see below" if not row.supported else
            "config.json only: plan, not train" if row.config_only else "")
    return (row.name, row.source, row.family or "—", count(row.total_params),
            count(row.active_params), row.dtype or "—", format_bytes(row.size), *fits, note)


def models_table(rows) -> str:
    """The rows of ``slideformer models`` for people: a table, then why the refused ones are."""
    table = [_COLUMNS] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    refused = [r for r in rows if not r.supported]
    if refused:
        lines.append("\nNot supported:")
        lines += [f"{r.name}: " + r.reason.replace("\n", "\n    ") for r in refused]
    return "\n".join(lines)


def _models(a) -> int:
    from slideformer.engine.models.discover import discover_models
    from slideformer.engine.models.stores import default_roots

    rows = discover_models(a.folder)
    if a.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    roots = default_roots()
    searched = [roots.hf_cache, *roots.ollama, *roots.lm_studio, *map(Path, a.folder)]
    where = ", ".join(str(p) for p in searched if p.is_dir()) or "nowhere: none of them exists"
    print(models_table(rows) if rows else "No models found.")
    print(f"\nSearched: {where}")
    return 0
