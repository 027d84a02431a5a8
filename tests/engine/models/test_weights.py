"""Safetensors I/O: export round trips through transformers, sharding, lazy per-layer reading."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.weights import (TOKENIZER_FILES, Checkpoint, hf_name, stored_views,
                                               write_hf_folder)

IDS = torch.randint(0, TinyShape().vocab, (2, 19), generator=torch.Generator().manual_seed(0))


def named_tensors(model):
    """(checkpoint name, tensor) pairs of a DenseModel, as an exporter hands them over."""
    for item, flat, layout in model.items():
        yield from stored_views(model.spec, item, layout.views(flat.detach()))


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_export_loads_in_transformers(tiny_model, tmp_path, load_dense, load_hf):
    model = load_dense(tiny_model)
    out = write_hf_folder(tmp_path / "out", model.spec, named_tensors(model), dtype=torch.float32,
                          tokenizer_dir=tiny_model)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_model.iterdir())
    for f in TOKENIZER_FILES:
        if (tiny_model / f).is_file():
            assert (out / f).read_bytes() == (tiny_model / f).read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (tiny_model / "config.json").read_text())

    # the same fp32 weights: bit-identical logits (test_models compares ours with these)
    assert torch.equal(hf_logits(load_hf(out)), hf_logits(load_hf(tiny_model)))


def test_sharded_export(tiny_model_factory, tmp_path, load_dense, load_hf):
    src = tiny_model_factory("qwen2")  # has biases: small tensors between the big ones
    model = load_dense(src)
    limit = 64 << 10  # one MLP matrix (60 KiB) per shard; the embedding (144 KiB) alone exceeds it
    out = write_hf_folder(tmp_path / "out", model.spec, named_tensors(model),
                          dtype=torch.float32, max_shard_bytes=limit)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 10 and not (out / "model.safetensors").exists()
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                      for k in range(1, len(shards) + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    total = 0
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= limit or len(sizes) == 1, shard  # only a lone big tensor may exceed
        total += nbytes
    assert index["metadata"]["total_size"] == total

    assert torch.equal(hf_logits(load_hf(out)), hf_logits(load_hf(src)))
    ckpt = Checkpoint(out)
    for item, flat, _ in model.items():
        assert torch.equal(ckpt.read_item(model.spec, item, torch.empty_like(flat)), flat)


def test_bf16_export_reads_back_rounded(tiny_model_factory, tmp_path, load_dense):
    model = load_dense(tiny_model_factory("qwen3"))
    out = write_hf_folder(tmp_path / "out", model.spec, named_tensors(model))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ckpt = Checkpoint(out)
    assert ckpt.dtype() == "BF16"
    for item, flat, _ in model.items():
        got = ckpt.read_item(model.spec, item, torch.empty_like(flat))
        assert torch.equal(got, flat.detach().to(torch.bfloat16).float())


def test_pieces_convert_as_whole_tensors_and_no_file_is_mapped(tiny_model_factory, tmp_path,
                                                                load_dense, monkeypatch):
    """bf16 shards read into fp32 buffers a few hundred values at a time (an odd piece size, so
    pieces end inside rows) give the whole-tensor conversion, and the stored tensors bit for bit
    as safetensors reads them; the files are read, never memory-mapped (mapped pages would
    count in the process's RSS: docs/design/lora.md)."""
    from slideformer.engine.models import weights
    model = load_dense(tiny_model_factory("qwen2"))
    out = write_hf_folder(tmp_path / "out", model.spec, named_tensors(model), max_shard_bytes=64 << 10)
    monkeypatch.setattr(weights, "READ_CHUNK", 2 * 251)
    ckpt = Checkpoint(out)
    for item, flat, _ in model.items():
        got = ckpt.read_item(model.spec, item, torch.empty_like(flat))
        assert torch.equal(got, flat.detach().to(torch.bfloat16).float())
    for shard in sorted(out.glob("*.safetensors"))[:3]:
        with safe_open(str(shard), framework="pt") as f:
            for k in f.keys():
                assert torch.equal(ckpt.tensor(k).view(torch.int16), f.get_tensor(k).view(torch.int16))
    if Path("/proc/self/maps").exists():
        assert str(out) not in Path("/proc/self/maps").read_text()
    ckpt.close()


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_refused(tiny_model_factory, tmp_path):
    """safe_open checked this when it opened a file; the reader checks it from the header."""
    import shutil
    import struct
    from slideformer.engine.errors import UserError
    d = tmp_path / "m"
    shutil.copytree(tiny_model_factory("llama"), d)
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] + 1, *header[name]["shape"][1:]]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(UserError, match=f"corrupt safetensors header \\(tensor '{name}': shape"):
        Checkpoint(d)


def test_export_replaces_existing_folder(tiny_model_factory, tmp_path, load_dense):
    model = load_dense(tiny_model_factory("llama"))
    out = tmp_path / "out"
    write_hf_folder(out, model.spec, named_tensors(model), max_shard_bytes=64 << 10)
    write_hf_folder(out, model.spec, named_tensors(model))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no .partial / .old left behind


# ---- lazy reading ------------------------------------------------------------------------------
# 32 layers of 7 MB (fp32): reading one layer must cost about one layer, not the 226 MB file.
WIDE = TinyShape(layers=32, hidden=256, heads=4, kv_heads=2, intermediate=2048)

RSS_PROBE = textwrap.dedent("""
    import json, sys
    import psutil, torch
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.models.weights import Checkpoint, item_layout, item_names

    def peak():
        # VmHWM, not ru_maxrss: on Linux a child's ru_maxrss includes its parent's peak
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    folder, which = sys.argv[1], sys.argv[2]
    spec = load_spec(folder)
    items = ["layer7"] if which == "one" else item_names(spec)
    try:  # reset VmHWM to the current RSS; without it the delta is an over-estimate
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = psutil.Process().memory_info().rss
    ckpt = Checkpoint(folder)
    ckpt.check(spec)
    bufs = [ckpt.read_item(spec, i, torch.empty(item_layout(spec, i).numel)) for i in items]
    print(json.dumps({"delta": peak() - before}))
""")


def peak_rss_delta(folder: Path, which: str) -> int:
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(folder), which], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).parents[3]).stdout
    return json.loads(out.splitlines()[-1])["delta"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_reading_one_layer_costs_one_layer(tiny_model_factory):
    folder = tiny_model_factory("llama", WIDE)
    size = Checkpoint(folder).size_on_disk()
    assert size > 200e6
    one = peak_rss_delta(folder, "one")
    everything = peak_rss_delta(folder, "all")
    assert everything > 0.9 * size  # the probe does see a full read
    assert one < 0.2 * size, f"reading one layer raised peak RSS by {one / 1e6:.0f} MB"
