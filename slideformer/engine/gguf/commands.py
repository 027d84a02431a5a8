"""CLI: ``import-gguf`` (GGUF file -> Hugging Face folder) and ``export-gguf`` (the reverse, with
an Ollama Modelfile, and ``--ollama NAME`` to create the Ollama model from it)."""
from __future__ import annotations

import time
from pathlib import Path

from slideformer.engine.errors import UserError
from slideformer.engine.gguf.kinds import EXPORT_KINDS


def register(sub) -> None:
    p = sub.add_parser("import-gguf", help="turn a GGUF file into a Hugging Face model folder")
    p.add_argument("file", help="the .gguf file (llama, mistral, qwen2, qwen3, qwen3moe, olmoe, "
                                "gemma3, ...: the README lists them), or gemma3-270m: Gemma 3 "
                                "270M from its pip packages")
    p.add_argument("--out", required=True, help="folder to create (bf16 safetensors)")
    p.set_defaults(func=_import)

    p = sub.add_parser("export-gguf", help="write a model folder as GGUF, with an Ollama Modelfile "
                                           "(a LoRA adapter folder: as a GGUF LoRA adapter)")
    p.add_argument("model", help="Hugging Face model folder, or a LoRA run's adapter folder "
                                 "(e.g. a run's final/)")
    p.add_argument("--type", choices=EXPORT_KINDS, default="bf16", help="type of the matrices")
    p.add_argument("--out", help="GGUF file to create (default: NAME-TYPE.gguf next to the folder)")
    p.add_argument("--base", help="a LoRA adapter's base model folder (default: the one its "
                                  "adapter_config.json names)")
    p.add_argument("--ollama", metavar="NAME",
                   help="then create the Ollama model NAME from it (ollama create; without "
                        "Ollama installed, prints the command to run)")
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
    """NAME-TYPE.gguf next to the folder (NAME-lora-TYPE.gguf for a LoRA adapter folder); a
    run's final/ goes into the run folder."""
    from slideformer.engine.gguf.exporter import folder_name, model_name
    from slideformer.engine.generate.adapter import is_adapter_folder
    from slideformer.engine.models.spec import load_spec
    d = model_dir.resolve()
    if is_adapter_folder(d):
        return d.parent / f"{folder_name(d)}-lora-{kind}.gguf"
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
    from slideformer.engine.generate.adapter import is_adapter_folder
    from slideformer.engine.gguf.ollama import check_name, command_line, send_to_ollama
    if is_adapter_folder(a.model):
        return _export_adapter(a)
    if a.ollama is not None:
        check_name(a.ollama)  # before minutes of export
    t0 = time.perf_counter()
    gguf_file, mf = export_with_modelfile(a.model, a.type, a.out)
    size = gguf_file.stat().st_size / 2**20
    print(f"created {gguf_file} ({a.type}, {size:,.1f} MiB) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    if a.ollama is None:
        print(f"Ollama: {command_line(('ollama', 'create', 'NAME', '-f', str(mf)))}")
    else:
        print(send_to_ollama(mf, a.ollama).message)
    return 0


def _export_adapter(a) -> int:
    from slideformer.engine.gguf.lora_adapter import export_lora_gguf
    if a.ollama is not None:
        raise UserError("--ollama", "needs a full model: Ollama runs an adapter on top of its "
                        "base model", "export the base model with --ollama, then add ADAPTER "
                        "and this adapter's GGUF to that Modelfile (or train with "
                        "lora.export_merged and export the merged folder)")
    out = export_lora_gguf(a.model, a.out or default_out(Path(a.model), a.type), a.type, a.base)
    print(f"created {out} (LoRA adapter, {a.type}, {out.stat().st_size / 2**20:,.1f} MiB)")
    print(f"llama.cpp: llama-cli -m BASE.gguf --lora {out}; Ollama: ADAPTER {out} in the "
          "base model's Modelfile")
    return 0
