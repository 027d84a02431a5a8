"""CLI: ``import-gguf`` (GGUF file -> Hugging Face folder) and ``export-gguf`` (the reverse)."""
from __future__ import annotations

import time
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.kinds import EXPORT_KINDS


def register(sub) -> None:
    p = sub.add_parser("import-gguf", help="turn a GGUF file into a Hugging Face model folder")
    p.add_argument("file", help="the .gguf file (llama, mistral, qwen2, qwen3, qwen3moe, gemma3), or "
                                "gemma3-270m: Gemma 3 270M from its pip packages")
    p.add_argument("--out", required=True, help="folder to create (bf16 safetensors)")
    p.set_defaults(func=_import)

    p = sub.add_parser("export-gguf", help="write a model folder as GGUF, with an Ollama Modelfile")
    p.add_argument("model", help="Hugging Face model folder (e.g. a run's final/)")
    p.add_argument("--type", choices=EXPORT_KINDS, default="bf16", help="type of the matrices")
    p.add_argument("--out", help="GGUF file to create (default: NAME-TYPE.gguf next to the folder)")
    p.set_defaults(func=_export)


def _import(a) -> int:
    from platformdirs import user_cache_dir

    from slideformer.engine.gguf.installed import GEMMA3, gemma3_gguf
    from slideformer.engine.gguf.importer import import_gguf
    from slideformer.engine.models.spec import load_spec
    t0 = time.perf_counter()
    src = a.file
    if src == GEMMA3 and not Path(src).exists():
        src = gemma3_gguf(Path(user_cache_dir("slideformer")) / "gguf")
    out = import_gguf(src, a.out)
    spec = load_spec(out)
    print(f"created {out} ({spec.model_type}, {spec.num_layers} layers, "
          f"{spec.num_params:,} parameters) in {time.perf_counter() - t0:.1f} s")
    return 0


def default_out(model_dir: Path, kind: str) -> Path:
    """NAME-TYPE.gguf next to the folder; a run's final/ goes into the run folder."""
    from slideformer.engine.gguf.exporter import model_name
    from slideformer.engine.models.spec import load_spec
    d = model_dir.resolve()
    return d.parent / f"{model_name(d, load_spec(d))}-{kind}.gguf"


def export_with_modelfile(model_dir: Path | str, kind: str, out: Path | str | None = None) -> tuple[Path, Path]:
    """Export ``model_dir`` as GGUF and write ``<file stem>.Modelfile`` next to it."""
    from slideformer.engine.gguf.exporter import export_gguf
    from slideformer.engine.gguf.modelfile import modelfile
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.tokenizer import load_tokenizer
    model_dir = Path(model_dir)
    out = Path(out) if out else default_out(model_dir, kind)
    mf = out.with_suffix(".Modelfile")
    if mf.exists():
        raise UserError(mf, "exists", "choose another --out, or move the old files away first")
    gguf_file = export_gguf(model_dir, out, kind)
    text = modelfile(gguf_file.name, load_tokenizer(model_dir),
                     load_spec(model_dir).max_position_embeddings)
    mf.write_text(text, encoding="utf-8")
    return gguf_file, mf


def _export(a) -> int:
    t0 = time.perf_counter()
    gguf_file, mf = export_with_modelfile(a.model, a.type, a.out)
    size = gguf_file.stat().st_size / 2**20
    print(f"created {gguf_file} ({a.type}, {size:,.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    print(f"Ollama: ollama create NAME -f {mf}")
    return 0
