"""Building the host state of a model, and moving it to and from files.

``build_host_state`` allocates every item's :class:`HostItem` and fills the masters from the
model's safetensors, one item at a time. Training checkpoints store the exact state (weights,
remainders, moments) of every item (:func:`state_tensors`; the files are slideformer.engine.train.checkpoint's
business); the final export writes a Hugging Face folder of the master weights.
"""
from __future__ import annotations

import shutil
from collections.abc import Collection
from pathlib import Path

import torch

from slideformer.engine.models.bnb4 import load_note
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.models.weights import (Checkpoint, item_layout, item_names, stored_views,
                                               write_hf_folder)
from slideformer.engine.runtime.host_state import HostItem
from slideformer.engine.runtime.lora import FrozenItem, build_adapters
from slideformer.engine.testhooks import pause_at


def build_host_state(spec: ModelSpec, backend, compute_dtype, moments_dtype,
                     tier=None, layer_grads: bool = True,
                     borrowed: Collection[int] = (),
                     on_device: Collection[str] = ()) -> dict[str, HostItem]:
    """Allocate the host state of every item (zero moments, uninitialised weights).

    ``tier``: an slideformer.engine.runtime.nvme.NvmeTier; the items it chose keep their moments on disk.
    ``layer_grads``: decoder layers own gradient buffers (needed with clipping); False: they
    borrow the executor's gradient ring (training without clipping only). ``borrowed``: layers
    that own none in any case (with clipping, the executor's speculative layers:
    slideformer.engine.runtime.shapes.speculative_layers, and its regenerated ones:
    slideformer.engine.runtime.shapes.regen_layers). ``on_device``: the items the executor updates on
    the device (their gradient stays there: ExecShape.device_update, device_layers).
    """
    def owns_grad(name: str) -> bool:
        if name in on_device:
            return False
        return not name.startswith("layer") or (layer_grads and int(name[5:]) not in borrowed)
    return {name: HostItem(name, item_layout(spec, name), compute_dtype, moments_dtype,
                           backend.host_alloc, _alloc, tier, grad=owns_grad(name))
            for name in item_names(spec)}


def build_frozen_state(spec: ModelSpec, backend, compute_dtype, moments_dtype, lora,
                       nf4: bool = False, tier=None) -> dict[str, HostItem | FrozenItem]:
    """The host state of adapter training (slideformer.engine.runtime.lora): the base items frozen in the
    compute dtype (``nf4``: the decoder layers in NF4, as QLoRA; the embedding and head stay
    unquantised), and one trained adapter item ``lora{i}`` per decoder layer.

    ``tier``: an slideformer.engine.runtime.nvme.NvmeTier; the layers it chose keep their base weights
    on disk (written as :func:`load_weights` sets them, one layer at a time)."""
    host: dict = {name: FrozenItem(name, item_layout(spec, name), compute_dtype, backend.host_alloc,
                                   nf4=nf4 and name.startswith("layer"), tier=tier)
                  for name in item_names(spec)}
    host.update(build_adapters(spec, lora, backend, compute_dtype, moments_dtype))
    return host


def _alloc(numel: int, dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)


def load_weights(host: dict[str, HostItem], spec: ModelSpec, model_dir: Path | str, emit=None) -> None:
    """Fill every model item's master from the model folder (one item in memory at a time);
    returns once the items in the NVMe tier are written (a failed write is raised here).

    A frozen item is filled straight from the files, into its RAM bytes or its NVMe file's
    staging buffer: in its dtype (Checkpoint.read_item converts tensor by tensor), or quantised
    (Checkpoint.read_nf4_item: the 4-bit weights of a bitsandbytes folder are copied, float ones
    quantised tensor by tensor). A trained item is read into an fp32 buffer, freed before the
    next item's is allocated (slideformer.engine.plan.memory.loading counts one)."""
    from slideformer.engine.events import Log, Progress
    ckpt = Checkpoint(model_dir)
    ckpt.check(spec)
    names = item_names(spec)
    if emit is not None and ckpt.quantized:
        nf4 = any(isinstance(i, FrozenItem) and i.quant is not None for i in host.values())
        emit(Log("info", load_note(ckpt, nf4)))
    for k, name in enumerate(names):
        item = host[name]
        if isinstance(item, FrozenItem):
            with item.stored(write=True) as w:
                if item.quant is not None:
                    ckpt.read_nf4_item(spec, name, item.quant, w)
                else:
                    _check_finite(ckpt, spec, name, ckpt.read_item(spec, name, w))
        else:
            buf = ckpt.read_item(spec, name, torch.empty(item.numel, dtype=torch.float32))
            _check_finite(ckpt, spec, name, buf)
            item.set_master(buf)
            del buf
        if emit is not None:
            emit(Progress("loading weights", k + 1, len(names)))
    ckpt.close()
    for item in host.values():
        if item.disk is not None:
            item.disk.flush()


def _check_finite(ckpt: Checkpoint, spec: ModelSpec, item: str, flat: torch.Tensor) -> None:
    """Refuse weights holding NaN or infinity (training from them only yields NaN losses)."""
    if bool(torch.isfinite(flat).all()):
        return
    for name, view in stored_views(spec, item, item_layout(spec, item).views(flat)):
        ckpt.check_finite(name, view)


def master_tensors(host: dict[str, HostItem], spec: ModelSpec):
    """(checkpoint name, fp32 master) of every tensor, one item materialised at a time."""
    for name in item_names(spec):
        master = host[name].master()
        yield from stored_views(spec, name, item_layout(spec, name).views(master))
        pause_at("export.item")


def export_model(host, spec: ModelSpec, out_dir: Path | str, tokenizer_dir: Path | str,
                 dtype: torch.dtype, shard_bytes: int) -> Path:
    """Write the master weights as a Hugging Face folder (atomic; a failed write leaves no
    partial folder behind, and an existing ``out_dir`` as it was)."""
    out_dir = Path(out_dir)
    try:
        return write_hf_folder(out_dir, spec, master_tensors(host, spec), dtype=dtype,
                               max_shard_bytes=shard_bytes, tokenizer_dir=tokenizer_dir)
    except BaseException:
        shutil.rmtree(out_dir.with_name(out_dir.name + ".partial"), ignore_errors=True)
        raise


def state_tensors(host: dict[str, HostItem]) -> dict[str, dict[str, torch.Tensor]]:
    """What a training checkpoint stores, per trained item (slideformer.engine.train.checkpoint writes and
    reads it); a frozen base is not rewritten."""
    return {name: item.state_tensors() for name, item in host.items()
            if not isinstance(item, FrozenItem)}
