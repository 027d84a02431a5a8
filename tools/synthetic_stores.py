"""Model stores laid out as their tools write them, for the discovery tests, benchmark and
screenshot: a Hugging Face hub cache entry, an Ollama tag, a GGUF file with a real header.

Weights the scan never reads are sparse files of their real size: a 7B model's folder takes no
disk, yet its size on disk reads as 15 GB, as it would on a user's machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np

from slideformer.engine.gguf.exporter import FILE_TYPES, _byte_shape, plan
from slideformer.engine.gguf.names import arch_name
from slideformer.engine.models.spec import spec_from_config

OLLAMA_MODEL = "application/vnd.ollama.image.model"


def sparse_file(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk (zeros where it is read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def hub_entry(cache: Path, repo_id: str, files: dict[str, bytes | int],
              commit: str = "1" * 40) -> Path:
    """``models--org--name`` of the hub cache ``cache``: each file a blob named by its hash,
    the snapshot ``commit`` linking to them (a copy where links are not allowed) and
    ``refs/main``. A file is its bytes, or a size (a sparse file). Returns the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        key = data if isinstance(data, bytes) else f"{repo_id}/{name}/{data}".encode()
        blob = repo / "blobs" / hashlib.sha256(key).hexdigest()
        if isinstance(data, bytes):
            blob.write_bytes(data)
        else:
            sparse_file(blob, data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(os.path.relpath(blob, link.parent))
        except OSError:  # Windows without developer mode: the hub copies too
            shutil.copyfile(blob, link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    """The files of a (small) model folder, for :func:`hub_entry`."""
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


def ollama_entry(root: Path, name: str, gguf_file: Path) -> Path:
    """The tag ``name`` (``model:tag``, or ``namespace/model:tag``) of Ollama's store ``root``,
    its model layer ``gguf_file`` moved into the blobs; returns the blob. (Another tag of the
    same blob: :func:`write_manifest` with its digest.)"""
    path, _, tag = name.partition(":")
    namespace, _, model = path.rpartition("/")
    with open(gguf_file, "rb") as f:
        digest = hashlib.sha256(f.read(1 << 20) + str(gguf_file.stat().st_size).encode()).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.replace(gguf_file, blob)
    write_manifest(root, namespace or "library", model, tag or "latest", digest, blob.stat().st_size)
    return blob


def write_manifest(root: Path, namespace: str, model: str, tag: str, digest: str,
                   size: int) -> Path:
    """A manifest whose model layer is ``blobs/sha256-<digest>`` (present or not)."""
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / model / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [{"mediaType": OLLAMA_MODEL, "digest": f"sha256:{digest}", "size": size},
              {"mediaType": "application/vnd.ollama.image.template",
               "digest": "sha256:" + "0" * 64, "size": 100}]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return manifest


def gguf_header_file(path: Path, config: dict, kind: str = "q4_0", name: str = "model") -> Path:
    """A GGUF file of the model ``config`` (a config.json dict) with its full header (metadata,
    a vocabulary of ``vocab_size`` tokens and merges, the tensor table of ``kind``) and sparse
    tensor data."""
    spec = spec_from_config(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, arch_name(spec.model_type))
    w.add_name(name)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_file_type(FILE_TYPES[kind])
    if spec.moe is not None:
        w.add_expert_count(spec.moe.experts)
        w.add_expert_used_count(spec.moe.top_k)
        w.add_expert_feed_forward_length(spec.moe.width)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(spec.vocab_size)])
    w.add_token_types([1] * spec.vocab_size)
    w.add_token_merges([f"tok{i} tok{i + 1}" for i in range(spec.vocab_size - 256)])
    total = 0
    for p in plan(spec, kind):
        bshape, dtype, nbytes = _byte_shape(p.shape, p.qtype)
        w.add_tensor_info(p.gguf, bshape, np.dtype(dtype), nbytes,
                          raw_dtype=None if dtype != np.uint8 else p.qtype)
        total += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    if dict(spec.rope_scaling or ()).get("rope_type") == "llama3":  # as llama.cpp writes it
        w.add_tensor_info("rope_freqs.weight", (spec.head_dim // 2,), np.dtype(np.float32),
                          2 * spec.head_dim)
        total += gguf.GGUFWriter.ggml_pad(2 * spec.head_dim, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    out = w.fout[0]
    out.truncate(gguf.GGUFWriter.ggml_pad(out.tell(), w.data_alignment) + total)
    w.close()
    return path


def _config(model_type: str, hidden: int, intermediate: int, layers: int, heads: int,
            kv_heads: int, vocab: int, **extra) -> dict:
    return {"model_type": model_type, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", **extra}


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONFIGS = {  # the architecture values of the published config.json files
    "Llama-3.2-1B-Instruct": _config("llama", 2048, 8192, 16, 32, 8, 128256, head_dim=64,
                                     rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                     tie_word_embeddings=True, max_position_embeddings=131072),
    "Llama-3.2-3B-Instruct": _config("llama", 3072, 8192, 28, 24, 8, 128256, head_dim=128,
                                     rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                     tie_word_embeddings=True, max_position_embeddings=131072),
    "SmolLM2-1.7B-Instruct": _config("llama", 2048, 8192, 24, 32, 32, 49152, rope_theta=130000.0,
                                     tie_word_embeddings=True, max_position_embeddings=8192),
    "Qwen2.5-7B-Instruct": _config("qwen2", 3584, 18944, 28, 28, 4, 152064, rope_theta=1e6,
                                   max_position_embeddings=32768),
    "Qwen2.5-0.5B-Instruct": _config("qwen2", 896, 4864, 24, 14, 2, 151936, rope_theta=1e6,
                                     tie_word_embeddings=True, max_position_embeddings=32768),
    "Qwen3-4B": _config("qwen3", 2560, 9728, 36, 32, 8, 151936, head_dim=128, rope_theta=1e6,
                        tie_word_embeddings=True, max_position_embeddings=40960),
    "Qwen3-30B-A3B": _config("qwen3_moe", 2048, 6144, 48, 32, 4, 151936, head_dim=128,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                             norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960),
    "Mistral-7B-Instruct-v0.3": _config("mistral", 4096, 14336, 32, 32, 8, 32768,
                                        rope_theta=1e6, max_position_embeddings=32768),
}
"""Real models' configs, for pictures and benchmarks that should look like a user's machine."""


def weights_bytes(config: dict) -> int:
    """The bytes of a model's bf16 safetensors (its parameters, 2 bytes each)."""
    return 2 * spec_from_config(config).num_params
