"""Safetensors weights: lazy per-item reading into flat buffers, and Hugging Face folder export.

Only safetensors are read (never pickle: a model folder is untrusted input). Reading goes one
tensor at a time with plain reads at the offsets of the file's header, straight into the
destination buffer (a tensor of another dtype through a scratch of at most :data:`READ_CHUNK`
bytes), so loading a layer costs that layer's bytes, not the checkpoint's. The files are never
memory-mapped: safetensors' ``safe_open`` maps them, and every page a read touches then counts
in the process's resident memory until the file is closed, which after a whole load is the
whole checkpoint (286 GiB of "RSS" for a 123B model on a 64 GiB host). Read pages go to the
page cache, which the OS drops under pressure and which is not the process's RSS.
"""
from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import shutil
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Iterable, Iterator

from safetensors import SafetensorError

if TYPE_CHECKING:  # reading headers needs no torch (``info``); writing imports it
    import torch

from slideformer.engine.errors import UserError
from slideformer.engine.jsonfile import parse_json, read_json
from slideformer.engine.models import bnb4, mxfp4
from slideformer.engine.models.spec import Layout, ModelSpec
from slideformer.engine.testhooks import pause_at

TOWER_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
"""Where multimodal folders keep their text model's tensors (Gemma 3 4B and up: transformers
writes ``language_model.model.*``; some conversions ``model.language_model.*``)."""
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
"""Safetensors dtypes a master weight can be read from (quantized ints are not cast)."""
READ_CHUNK = 64 << 20
"""Bytes of a tensor read at a time when its stored dtype is not the destination's: the only
copy of file data held beside the destination buffer."""
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16,
              "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64,
              "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
"""Bits per element of each safetensors dtype (those safetensors 0.8 accepts)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def hf_name(item: str, local: str) -> str:
    """Checkpoint name of an item's tensor: item is 'embed', 'head' or 'layer{i}'."""
    if item.startswith("layer"):
        return f"model.layers.{item[5:]}.{local}"
    return local if local == "lm_head.weight" else f"model.{local}"


def stored_as(spec: ModelSpec, item: str, local: str) -> list[str]:
    """The checkpoint names an item's tensor ``local`` is stored as: one, or one per expert
    for stacked experts (their slices along dim 0, in order; ModelSpec.stored_names)."""
    names = spec.stored_names(local) if item.startswith("layer") else [local]
    return [hf_name(item, n) for n in names]


def stored_views(spec: ModelSpec, item: str, views: dict) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(checkpoint name, the view of the item's buffer it fills) for every stored tensor."""
    for local, view in views.items():
        names = stored_as(spec, item, local)
        if len(names) == 1:
            yield names[0], view
        else:
            yield from zip(names, view)


def stored_shapes(spec: ModelSpec, item: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every stored tensor of an item."""
    for local, _, shape in item_layout(spec, item).entries:
        names = stored_as(spec, item, local)
        for name in names:
            yield name, tuple(shape[1:]) if len(names) > 1 else tuple(shape)


def item_names(spec: ModelSpec) -> list[str]:
    return ["embed"] + [f"layer{i}" for i in range(spec.num_layers)] + ["head"]


def item_layout(spec: ModelSpec, item: str) -> Layout:
    if item == "embed":
        return spec.embed_layout
    return spec.head_layout if item == "head" else spec.layout(int(item.removeprefix("layer")))


def _read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header with a clear error for truncated or corrupt files.

    Returns:
        The tensor entries, and the byte offset of the data their ``data_offsets`` count from.
    """
    fix = "re-download or re-copy this file"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(path, "is truncated (no safetensors header)", fix)
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > size - 8 or n > 100_000_000:
            raise UserError(path, "has a corrupt safetensors header (bad length)", fix)
        try:
            header = parse_json(f.read(n), path, fix)
        except UserError as e:
            raise UserError(path, f"has a corrupt safetensors header ({e.problem})",
                            fix) from None
    if not isinstance(header, dict):
        raise UserError(path, "has a corrupt safetensors header", fix)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise UserError(path, "has a corrupt safetensors header (__metadata__ is not a table "
                        "of strings)", fix)
    if not all(_entry_ok(v) for v in header.values()):
        raise UserError(path, "has a corrupt safetensors header (bad tensor entries)", fix)
    for name, v in header.items():
        _check_extent(path, name, v, fix)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise UserError(path, f"is truncated ({size} bytes, header needs {8 + n + end})", fix)
    return header, 8 + n


def _check_extent(path: Path, name: str, v: dict, fix: str) -> None:
    """A tensor's bytes are those of its dtype and shape (as safe_open checked when it opened a
    file), so every read stays inside the tensor."""
    (begin, end), bits, shape = v["data_offsets"], DTYPE_BITS.get(v["dtype"]), v["shape"]
    if bits is None:
        raise UserError(path, f"stores tensor '{name}' as {v['dtype']!r}, not a safetensors "
                        "dtype", fix)
    if (not 0 <= begin <= end or min(shape, default=0) < 0
            or math.prod(shape) * bits != 8 * (end - begin)):
        raise UserError(path, f"has a corrupt safetensors header (tensor '{name}': shape "
                        f"{shape} of {v['dtype']} in bytes {begin}..{end})", fix)


def _index_files(index: Path) -> list[str]:
    """The shard names of a safetensors index: plain names inside the model folder.

    An index is untrusted input like the rest of the folder: a name that is absolute or climbs
    out with ``..`` would make the loader read any file the user can read.
    """
    fix = "restore the index file from the model's source"
    data = read_json(index, fix)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if (not isinstance(weight_map, dict) or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())):
        raise UserError(index, "is not a valid safetensors index (no weight_map of file names)", fix)
    files = sorted(set(weight_map.values()))
    for f in files:
        parts = PurePosixPath(f.replace("\\", "/")).parts
        if not parts or parts[0] == "/" or ".." in parts or PureWindowsPath(f).drive:
            raise UserError(index, f"names the shard {f!r}, outside the model folder", fix)
        if not f.endswith(".safetensors"):
            raise UserError(index, f"names the shard {f!r}, not a .safetensors file", fix)
    return files


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name the file system refuses (too long, a NUL)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _entry_ok(v) -> bool:
    """A header entry: {"dtype": str, "shape": [int, ...], "data_offsets": [begin, end]}."""
    return (isinstance(v, dict) and isinstance(v.get("dtype"), str) and _ints(v.get("shape"))
            and _ints(v.get("data_offsets")) and len(v["data_offsets"]) == 2)


def _ints(xs) -> bool:
    return isinstance(xs, list) and all(isinstance(x, int) for x in xs)


class Checkpoint:
    """The safetensors files of a model folder: name -> file, header shapes and dtypes."""

    def __init__(self, model_dir: Path | str):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        self.index = index if index.is_file() else None
        """The index file the shards come from, or None (every ``*.safetensors``)."""
        if self.index is not None:
            files = _index_files(index)
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise UserError(self.dir, "has no *.safetensors weights",
                                "pick a folder with model.safetensors (pickle .bin files are "
                                "not loaded for safety; convert them to safetensors first)")
        self.where: dict[str, Path] = {}
        self.meta: dict[str, dict] = {}
        self._data: dict[Path, int] = {}
        """Where each file's tensor data starts (after its header)."""
        for f in files:
            path = self.dir / f
            if not _is_file(path):
                raise UserError(path, f"is named in {index.name} but missing",
                                "download the missing shard into the model folder")
            header, self._data[path] = _read_header(path)
            for name, info in header.items():
                self.where[name], self.meta[name] = path, info
        for name in list(self.meta):  # a text tower under its multimodal model's prefix
            for prefix, plain in TOWER_PREFIXES:
                alias = plain + name[len(prefix):]
                if name.startswith(prefix) and alias not in self.meta:
                    self.where[alias], self.meta[alias] = self.where[name], self.meta[name]
        self.quantized = any(bnb4.STATE in name for name in self.meta)
        """Whether some weights are pre-quantised 4-bit (slideformer.engine.models.bnb4)."""
        self.mxfp4 = {name: mxfp4.stored_shape(self.meta, name) for name in
                      (n.removesuffix("_blocks") for n in self.meta if n.endswith("_blocks"))
                      if mxfp4.is_mxfp4(self.meta, name)}
        """Tensors stored as MXFP4 blocks and scales (models.mxfp4) -> their dequantised shape
        (None: parts that do not fit together)."""
        for name in self.mxfp4:
            self.where[name] = self.where[mxfp4.parts(name)[0]]
        self._files: dict[Path, io.FileIO] = {}
        """Files opened for reading (unbuffered, never mapped), until :meth:`close`."""

    def size_on_disk(self) -> int:
        return sum(p.stat().st_size for p in set(self.where.values()))

    def dtype(self) -> str:
        """The weights' storage type as reports show it ("BF16", or bnb4.DESCRIPTION)."""
        if self.quantized:
            return bnb4.DESCRIPTION
        if self.mxfp4:
            return mxfp4.DESCRIPTION
        return next(iter(self.meta.values()))["dtype"] if self.meta else "?"

    def _file(self, path: Path) -> io.FileIO:
        if path not in self._files:
            try:
                self._files[path] = open(path, "rb", buffering=0)
            except OSError as e:
                raise UserError(path, f"cannot be read ({e.strerror or e})",
                                "check that the file is there and readable") from None
        return self._files[path]

    def check(self, spec: ModelSpec) -> None:
        """Every tensor the spec needs is present with the right shape (headers only)."""
        for item in item_names(spec):
            for name, shape in stored_shapes(spec, item):
                self._meta_for(name, shape)

    def _meta_for(self, name: str, shape: tuple) -> None:
        if name in self.mxfp4:
            if self.mxfp4[name] != tuple(shape):
                blocks, scales = mxfp4.parts(name)
                raise UserError(self.where[name], f"MXFP4 tensor '{name}' has blocks "
                                f"{self.meta[blocks]['dtype']} {self.meta[blocks]['shape']} and "
                                f"scales {self.meta[scales]['dtype']} {self.meta[scales]['shape']}"
                                f", which do not give the shape config.json implies "
                                f"{list(shape)} (E, in, out)",
                                "the weights do not match config.json; use the matching files")
            return
        if name in self.meta and bnb4.is_quantised(self.meta, name):
            bnb4.check_weight(self, name, tuple(shape))
            return
        if name not in self.meta:
            files = f"the shards {self.index.name} names" if self.index else "the safetensors files"
            raise UserError(self.dir, f"tensor '{name}' is missing from {files}",
                            "the weights do not match config.json; use the matching files")
        if self.meta[name]["dtype"] not in FLOAT_DTYPES:
            raise UserError(self.where[name], f"tensor '{name}' is stored as "
                            f"{self.meta[name]['dtype']}; only floating-point weights "
                            f"({', '.join(FLOAT_DTYPES)}) can be fine-tuned",
                            "use the unquantized release of the model (bf16, fp16 or fp32 "
                            "safetensors)")
        got = tuple(self.meta[name]["shape"])
        if got != tuple(shape):
            raise UserError(self.where[name], f"tensor '{name}' has shape {list(got)}, "
                            f"config.json implies {list(shape)}",
                            "the weights do not match config.json; use the matching files")

    def tensor(self, name: str) -> torch.Tensor:
        """One stored tensor as it is, read into memory of its own; an MXFP4 one dequantised
        to bf16."""
        import torch
        if name in self.mxfp4:
            return self._mxfp4_into(name, torch.empty(self.mxfp4[name], dtype=torch.bfloat16))
        return self._read_into(name, torch.empty(self.meta[name]["shape"], dtype=self._dtype(name)))

    def _dtype(self, name: str) -> torch.dtype:
        import torch
        code = self.meta[name]["dtype"]
        dtype = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                 "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                 "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                 "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}.get(code)
        if dtype is None:
            raise UserError(self.where[name], f"tensor '{name}' is stored as {code}, which "
                            "cannot be read", "use a release of the model in bf16, fp16 or fp32")
        return dtype

    def _read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (contiguous, the stored tensor's number of elements) with the stored
        tensor ``name``: read in place when the dtypes agree, else :data:`READ_CHUNK` bytes at
        a time into a scratch and converted into ``out`` (``copy_``: the same rounding as a
        copy of the whole tensor)."""
        import torch
        path, src = self.where[name], self._dtype(name)
        start, flat = self._data[path] + self.meta[name]["data_offsets"][0], out.view(-1)
        f = self._file(path)
        if src == out.dtype:
            _read_at(f, flat.view(torch.uint8), start, path)
            return out
        step = max(1, READ_CHUNK // src.itemsize)
        scratch = torch.empty(min(step, flat.numel()), dtype=src)
        for s in range(0, flat.numel(), step):
            part = scratch[:min(step, flat.numel() - s)]
            _read_at(f, part.view(torch.uint8), start + s * src.itemsize, path)
            flat[s:s + part.numel()].copy_(part)
        return out

    def _mxfp4_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        blocks, scales = (self.tensor(p) for p in mxfp4.parts(name))
        return mxfp4.dequantize(blocks, scales, out)

    def raw_bytes(self, name: str) -> bytes:
        """One stored tensor's bytes, read without torch."""
        begin, end = self.meta[name]["data_offsets"]
        with open(self.where[name], "rb") as f:
            f.seek(self._data[self.where[name]] + begin)
            return f.read(end - begin)

    def read_item(self, spec: ModelSpec, item: str, out: torch.Tensor) -> torch.Tensor:
        """Fill the flat buffer ``out`` with an item's tensors, converting dtype (4-bit
        weights are dequantised)."""
        for name, view in stored_views(spec, item, item_layout(spec, item).views(out)):
            self._meta_for(name, view.shape)
            if bnb4.is_quantised(self.meta, name):
                bnb4.dequantize(self, name, view)
            elif name in self.mxfp4:
                self._mxfp4_into(name, view)
            else:
                self._read_into(name, view)
        return out

    def read_nf4_item(self, spec: ModelSpec, item: str, quant, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (uint8, ``quant``: an slideformer.engine.runtime.nf4.Nf4Layout) with an item
        quantised: 4-bit weights copied as stored, float ones quantised here one at a time
        (peak: one tensor in fp32), each checked for NaN and infinity."""
        layout = item_layout(spec, item)
        shapes = {local: shape for local, _, shape in layout.entries}
        for t in quant.tensors:
            names = stored_as(spec, item, t.name)
            if len(names) > 1:  # stacked experts: quantised as one tensor
                for name in names:
                    self._meta_for(name, t.shape[1:])
                import torch
                quant.quantize_tensor(t, torch.stack([self._finite(n) for n in names]), out)
                continue
            name = names[0]
            self._meta_for(name, t.shape)
            if bnb4.is_quantised(self.meta, name):
                bnb4.copy_weight(self, name, t.shape, quant, t, out)
            else:
                quant.quantize_tensor(t, self._finite(name), out)
        for local, off in quant.raw:
            name = hf_name(item, local)
            self._meta_for(name, shapes[local])
            quant.raw_view(out, off, math.prod(shapes[local])).copy_(self._finite(name).reshape(-1))
        return out

    def _finite(self, name: str) -> torch.Tensor:
        t = self.tensor(name)
        self.check_finite(name, t)
        return t

    def check_finite(self, name: str, values: torch.Tensor) -> None:
        """Refuse weights holding NaN or infinity (training from them only yields NaN losses)."""
        import torch

        finite = torch.isfinite(values)  # one byte per value (plan: the load buffer)
        if bool(finite.all()):
            return
        bad = finite.numel() - int(finite.sum())
        raise UserError(self.where[name], f"tensor '{name}' holds {bad:,} NaN or infinite "
                        "values", "the weights are damaged: download or copy them again, or "
                        "use another checkpoint of the model")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _read_at(f: io.FileIO, buf: torch.Tensor, offset: int, path: Path) -> None:
    """Read ``buf.numel()`` bytes at ``offset`` of ``f`` into the uint8 tensor ``buf``."""
    view, done = memoryview(buf.numpy()), 0
    f.seek(offset)
    while done < len(view):  # a read returns at most ~2 GiB on Linux, less at the file's end
        n = f.readinto(view[done:])
        if not n:
            raise UserError(path, "is truncated (it ended inside a tensor)",
                            "re-download or re-copy this file")
        done += n


def write_hf_folder(out_dir: Path | str, spec: ModelSpec, tensors: Iterable[tuple[str, torch.Tensor]],
                    dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30,
                    tokenizer_dir: Path | str | None = None) -> Path:
    """Write a Hugging Face model folder atomically (temp folder, then rename).

    Args:
        tensors: (checkpoint name, tensor) pairs in any order; each is converted to ``dtype``
            (default bfloat16).
        max_shard_bytes: shard size limit; one shard is written as ``model.safetensors``.
        tokenizer_dir: a folder whose tokenizer files are copied alongside.
    """
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    out_dir = Path(out_dir)
    tmp = staging_dir(out_dir)
    # Each shard is written as soon as it is full (peak memory: one shard), under a temporary
    # name, and renamed once the shard count is known.
    parts: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        if shard:
            _save_shard(shard, tmp / f"part-{len(parts)}.safetensors")
            parts.append(list(shard))
            shard.clear()

    for name, t in _sharded(tensors, dtype, max_shard_bytes):
        if name is None:
            flush()
            continue
        shard[name] = t
        size += t.numel() * t.element_size()
    flush()
    n = len(parts)
    weight_map = {}
    for k, keys in enumerate(parts):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / f"part-{k}.safetensors", tmp / fname)
        weight_map.update({key: fname for key in keys})
    _write_index(tmp, weight_map, size, n)
    cfg = dict(spec.raw_config)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("quantization_config", None)  # the tensors written are plain floats
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / f
            if src.is_file():
                shutil.copy2(src, tmp / f)
    return publish_dir(tmp, out_dir)


def staging_dir(out_dir: Path) -> Path:
    """An empty temporary folder next to ``out_dir``, to fill and then :func:`publish_dir`."""
    tmp = out_dir.with_name(out_dir.name + ".partial")
    old = out_dir.with_name(out_dir.name + ".old")
    if old.is_dir() and not out_dir.exists():  # a crash between the two renames of publish_dir
        os.replace(old, out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp: Path, out_dir: Path) -> Path:
    """Flush the staged folder ``tmp`` and rename it to ``out_dir`` (replacing it whole)."""
    old = out_dir.with_name(out_dir.name + ".old")
    _fsync_dir(tmp)
    pause_at("publish.start")
    if out_dir.exists():  # the previous export stays whole until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        pause_at("publish.swap")
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    fsync_path(out_dir.parent)
    return out_dir


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file``, with its write failures raised as the OSError they are.

    safetensors reports a full disk or a read-only folder as ``SafetensorError: ... IoError(Os
    { code: 28, ... })``; callers handle OSError (slideformer.engine.train.checkpoint.write_error words it).
    """
    from safetensors.torch import save_file  # torch: only when writing

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"code: (\d+)", str(e))
        err = int(code.group(1)) if code else errno.EIO
        raise OSError(err, os.strerror(err), str(path)) from None


def _write_index(folder: Path, weight_map: dict[str, str], size: int, n_shards: int) -> None:
    if n_shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2))


def write_streamed_shards(folder: Path, shapes: list[tuple[str, tuple[int, ...]]],
                          tensors: Iterable[torch.Tensor], max_shard_bytes: int = 5 << 30) -> None:
    """Write bf16 safetensors shards whose tensors arrive one at a time (peak: one tensor).

    The shapes are known before the data (a GGUF file's tensor table), so each shard's header
    is written first and every tensor goes to disk as soon as it arrives.

    Args:
        shapes: (checkpoint name, shape) in the order ``tensors`` yields them.
        tensors: the tensors, any float dtype (converted to bf16).
    """
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in shapes:
        nbytes = 2 * math.prod(shape)
        if used and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    import torch
    n, it, weight_map = len(shards), iter(tensors), {}
    for k, entries in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in entries:
            header[name] = {"dtype": "BF16", "shape": list(shape),
                            "data_offsets": [off, off + 2 * math.prod(shape)]}
            off += 2 * math.prod(shape)
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in entries:
                t = next(it).to(torch.bfloat16).contiguous()
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{name}: got shape {tuple(t.shape)}, planned {shape}")
                f.write(t.view(torch.uint8).numpy().data)
    _write_index(folder, weight_map, sum(2 * math.prod(s) for _, s in shapes), n)


def _sharded(tensors, dtype, limit) -> Iterator[tuple[str | None, torch.Tensor | None]]:
    """Yield tensors (as contiguous ``dtype`` copies), with (None, None) between shards."""
    used = 0
    for name, t in tensors:
        t = t.detach().to("cpu", dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if used and used + nbytes > limit:
            yield None, None
            used = 0
        used += nbytes
        yield name, t


def _fsync_dir(path: Path) -> None:
    """Flush every file of a folder, then the folder itself."""
    for p in path.iterdir():
        fsync_path(p)
    fsync_path(path)


def fsync_path(path: Path) -> None:
    """Flush one file or folder (a folder: its entries, so renames inside it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
