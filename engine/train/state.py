"""Building the host state of a model, and moving it to and from files.

``build_host_state`` allocates every item's :class:`HostItem` and fills the masters from the
model's safetensors, one item at a time. Training checkpoints store the exact state (weights,
remainders, moments) per item in safetensors files; the final export writes a Hugging Face
folder of the master weights.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.errors import UserError
from engine.models.spec import ModelSpec
from engine.models.weights import Checkpoint, hf_name, item_layout, item_names, write_hf_folder
from engine.runtime.host_state import HostItem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_host_state(spec: ModelSpec, backend, compute_dtype, moments_dtype) -> dict[str, HostItem]:
    """Allocate the host state of every item (zero moments, uninitialised weights)."""
    return {name: HostItem(name, item_layout(spec, name), compute_dtype, moments_dtype,
                           backend.host_alloc, _alloc)
            for name in item_names(spec)}


def _alloc(numel: int, dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)


def load_weights(host: dict[str, HostItem], spec: ModelSpec, model_dir: Path | str, emit=None) -> None:
    """Fill every item's master from the model folder (one item in memory at a time)."""
    ckpt = Checkpoint(model_dir)
    ckpt.check(spec)
    for k, (name, item) in enumerate(host.items()):
        buf = torch.empty(item.numel, dtype=torch.float32)
        item.set_master(ckpt.read_item(spec, name, buf))
        if emit is not None:
            from engine.events import Progress
            emit(Progress("loading weights", k + 1, len(host)))
    ckpt.close()


def master_tensors(host: dict[str, HostItem], spec: ModelSpec):
    """(checkpoint name, fp32 master) of every tensor, one item materialised at a time."""
    for name, item in host.items():
        master = item.master()
        for local, view in item_layout(spec, name).views(master).items():
            yield hf_name(name, local), view


def export_model(host, spec: ModelSpec, out_dir: Path | str, tokenizer_dir: Path | str,
                 dtype: torch.dtype, shard_bytes: int) -> Path:
    """Write the master weights as a Hugging Face folder (atomic)."""
    return write_hf_folder(out_dir, spec, master_tensors(host, spec), dtype=dtype,
                           max_shard_bytes=shard_bytes, tokenizer_dir=tokenizer_dir)


def save_state(host: dict[str, HostItem], folder: Path) -> None:
    """Write every item's exact state into ``folder`` (one safetensors file per item)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, item in host.items():
        save_file({k: v.contiguous() for k, v in item.state_tensors().items()},
                  str(folder / f"{name}.safetensors"))


def load_state(host: dict[str, HostItem], folder: Path) -> None:
    """Restore every item's exact state from :func:`save_state`'s files."""
    for name, item in host.items():
        path = folder / f"{name}.safetensors"
        if not path.is_file():
            raise UserError(path, "is missing from the checkpoint",
                            "resume from another checkpoint, or start a new run")
        saved = load_file(str(path))
        for key, dst in item.state_tensors().items():
            if key not in saved or saved[key].shape != dst.shape or saved[key].dtype != dst.dtype:
                raise UserError(path, f"'{key}' does not match this run's model or precision",
                                "resume with the run's own config, or start a new run")
            dst.copy_(saved[key])
