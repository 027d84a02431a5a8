"""What a user can chat with: a Hugging Face model folder, a LoRA run's adapter folder, or a
training checkpoint of a run.

A model folder (a base model, a run's ``final/``) carries everything. An adapter folder (a LoRA
run's ``final/``) is its base model with the adapters added as each layer is read
(:mod:`slideformer.engine.generate.adapter`). A checkpoint
(``<run>/checkpoints/step-N``) holds only the exact training state of each item (bf16 weights +
16-bit remainders, see slideformer.engine.train.checkpoint); its architecture and tokenizer are those of the
run's base model, named by the run's ``config.toml``. Both give a weight reader with the same
``read_item(spec, item, out)`` as :class:`slideformer.engine.models.weights.Checkpoint`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from slideformer.engine import config as config_mod
from slideformer.engine.errors import UserError
from slideformer.engine.generate.adapter import Adapter, is_adapter_folder, read_adapter
from slideformer.engine.models.spec import ModelSpec, load_spec
from slideformer.engine.models.weights import Checkpoint, item_layout
from slideformer.engine.runtime.host_state import join_master
from slideformer.engine.train.checkpoint import MANIFEST, META


@dataclass(frozen=True)
class ModelSource:
    """A model resolved from the folder the user picked."""

    path: Path
    """The folder picked: a model folder or a checkpoint's ``step-N`` folder."""
    spec: ModelSpec
    tokenizer_dir: Path
    """The folder whose tokenizer files and generation settings the model uses."""
    checkpoint: bool
    """True for a training checkpoint (weights from its item files)."""
    adapter: Adapter | None = None
    """A LoRA adapter folder's adapters, added to its base's weights."""

    def open_weights(self):
        """A reader with ``read_item(spec, item, out)`` and ``close()``."""
        if self.checkpoint:
            return TrainingStateReader(self.path)
        reader = Checkpoint(self.adapter.base if self.adapter else self.path)
        reader.check(self.spec)
        return AdaptedReader(reader, self.adapter) if self.adapter else reader

    def generation_config(self) -> dict:
        """``generation_config.json`` of the model (empty when absent or unreadable)."""
        path = self.tokenizer_dir / "generation_config.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}


def is_training_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file() and (path / META).is_file()


def resolve_model(path: Path | str) -> ModelSource:
    """The model in ``path``: a Hugging Face folder or ``<run>/checkpoints/step-N``."""
    path = Path(path)
    if (path / "config.json").is_file():
        return ModelSource(path, load_spec(path), path, checkpoint=False)
    if is_adapter_folder(path):
        adapter = read_adapter(path)
        tokenizer = path if (path / "tokenizer.json").is_file() else adapter.base
        return ModelSource(path, adapter.spec, tokenizer, checkpoint=False, adapter=adapter)
    if is_training_checkpoint(path):
        run_dir = path.parent.parent
        cfg = config_mod.load(run_dir / "config.toml")
        base = Path(cfg.model.path)
        if not (base / "config.json").is_file():
            raise UserError(path, f"is a checkpoint of a run on {base}, which is gone",
                            "restore the run's base model folder, or pick the run's final/ folder")
        return ModelSource(path, load_spec(base), base, checkpoint=True)
    raise UserError(path, "is neither a model folder (config.json), an adapter folder "
                          "(adapter_config.json) nor a training checkpoint (manifest.json)",
                    "pick a Hugging Face model folder, a run's final/ folder or a "
                    "checkpoints/step-N folder")


class AdaptedReader:
    """The base model's weights with a LoRA adapter added to each layer as it is read
    (``W + s * B @ A``, computed in fp32)."""

    def __init__(self, base: Checkpoint, adapter: Adapter):
        self.base, self.adapter = base, adapter

    def read_item(self, spec: ModelSpec, item: str, out: torch.Tensor) -> torch.Tensor:
        self.base.read_item(spec, item, out)
        if item.startswith("layer"):
            self.adapter.add_to_layer(int(item[5:]), item_layout(spec, item).views(out))
        return out

    def close(self) -> None:
        self.base.close()


class TrainingStateReader:
    """Reads the weights of a training checkpoint: each item's exact fp32 master."""

    def __init__(self, folder: Path):
        self.folder = folder

    def read_item(self, spec: ModelSpec, item: str, out: torch.Tensor) -> torch.Tensor:
        path = self.folder / f"{item}.safetensors"
        numel = item_layout(spec, item).numel
        try:
            with safe_open(str(path), framework="pt") as f:
                w = f.get_tensor("w")
                rem = f.get_tensor("rem") if "rem" in f.keys() else None
        except (SafetensorError, OSError) as e:
            raise UserError(path, f"cannot be read ({e})",
                            "pick another checkpoint, or the run's final/ folder") from None
        if w.numel() != numel:
            raise UserError(path, f"holds {w.numel():,} weights, the model needs {numel:,}",
                            "the checkpoint does not belong to this run's model")
        if rem is not None:
            w = join_master(w, rem, torch.empty(numel, dtype=torch.float32))
        return out.copy_(w)

    def close(self) -> None:
        pass
