"""GPT-OSS's MXFP4 experts: read as transformers reads them (its Mxfp4Config(dequantize=True))."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.weights import Checkpoint
from slideformer.engine.runtime.nf4 import Nf4Layout

transformers = pytest.importorskip("transformers")

SHAPE = TinyShape(intermediate=128)
"""Expert width 64 and hidden 96: both multiples of MXFP4's block of 32."""
QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
"""The quantization_config of the releases (which modules stay in bf16)."""


@pytest.fixture(scope="module")
def mxfp4_folder(tiny_model_factory, tmp_path_factory):
    """The tiny GPT-OSS with its experts replaced by random MXFP4 blocks and scales (scales
    2**-7 .. 2**-4, so the weights stay near the init's size), saved as the releases are."""
    src = tiny_model_factory("gpt_oss", SHAPE)
    out = tmp_path_factory.mktemp("mxfp4") / "model"
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, i, o = tensors.pop(name).shape  # stored (E, in, out); MXFP4 holds (E, out, in)
        tensors[name + "_blocks"] = torch.randint(0, 256, (E, o, i // 32, 16), generator=g,
                                                  dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(120, 124, (E, o, i // 32), generator=g,
                                                  dtype=torch.uint8)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"quantization_config": QUANT}))
    return out


def test_mxfp4_experts_give_transformers_logits(mxfp4_folder, load_dense):
    ours = load_dense(mxfp4_folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_folder, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    ids = torch.randint(0, ours.spec.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours.logits(ids), ref(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    ckpt = Checkpoint(mxfp4_folder)
    assert ckpt.dtype().startswith("MXFP4")
    name = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(ckpt.tensor(name).float(), ref.model.layers[1].mlp.experts.down_proj.data)


def test_qlora_quantises_the_dequantised_experts(mxfp4_folder, tiny_model_factory):
    """The NF4 base of a QLoRA run read from MXFP4 is the NF4 of the dequantised weights."""
    spec = load_spec(mxfp4_folder)
    quant = Nf4Layout.build(spec.layer_layout, torch.float32)
    ckpt = Checkpoint(mxfp4_folder)
    got = ckpt.read_nf4_item(spec, "layer2", quant, torch.zeros(quant.nbytes, dtype=torch.uint8))
    flat = ckpt.read_item(spec, "layer2", torch.empty(spec.layer_layout.numel))
    want = quant.quantize(flat, torch.zeros(quant.nbytes, dtype=torch.uint8))
    assert torch.equal(got, want)


def test_scales_that_do_not_fit_the_blocks_are_refused(mxfp4_folder, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(mxfp4_folder, bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(UserError, match=r"MXFP4 tensor 'model.layers.0.mlp.experts.gate_up_proj'"
                                        r".*do not give the shape config.json implies"):
        Checkpoint(bad).check(load_spec(bad))
