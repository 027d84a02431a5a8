"""Gemma 4: the released configs read, what is refused, the multimodal folder's text tower, and
the logits' soft cap through the chunked cross-entropy (the logits and gradients of the tiny
models against transformers are test_models.py's; training test_family_training.py's)."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from slideformer.engine.errors import UserError
from slideformer.engine.kernels.linear_ce import (linear_ce_fwd_bwd, linear_ce_loss,
                                                  linear_ce_rows, reference_linear_cross_entropy)
from slideformer.engine.models.model import DenseModel
from slideformer.engine.models.spec import spec_from_config
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.weights import TOKENIZER_FILES, stored_views, write_hf_folder

transformers = pytest.importorskip("transformers")

ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                           "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
TEXT_31B = {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 5376,
            "intermediate_size": 21504, "num_hidden_layers": 60, "num_attention_heads": 32,
            "num_key_value_heads": 16, "num_global_key_value_heads": 4, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 1024, "max_position_embeddings": 262144,
            "hidden_activation": "gelu_pytorch_tanh", "attention_k_eq_v": True,
            "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
            "use_bidirectional_attention": "vision", "rope_parameters": ROPE,
            "tie_word_embeddings": True}
"""google/gemma-4-31B-it's text_config (its layer_types: Gemma4TextConfig's default pattern)."""
TEXT_26B = TEXT_31B | {"hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
                       "num_attention_heads": 16, "num_key_value_heads": 8,
                       "num_global_key_value_heads": 2, "enable_moe_block": True,
                       "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704}
"""google/gemma-4-26B-A4B-it's."""


def test_the_released_configs_read_as_transformers_builds_them():
    spec = spec_from_config({"model_type": "gemma4", "torch_dtype": "bfloat16",
                             "text_config": TEXT_31B})
    assert spec.model_type == "gemma4_text" and spec.moe is None and spec.logit_softcap == 30.0
    assert spec.layer_types.count("full_attention") == 10 and spec.sliding_window == 1024
    full, sliding = spec.layer_types.index("full_attention"), 0
    assert spec.attn_shapes[full] == (512, 4) and spec.attn_shapes[sliding] == (256, 16)
    assert "self_attn.v_proj.weight" not in spec.layout(full).names()
    assert spec.rope_scaling == (("partial_rotary_factor", 0.25), ("rope_type", "proportional"))
    assert spec.local_rope == (10000.0, None) and spec.attn_scale == 1.0
    assert round(spec.num_params / 1e9, 1) == 30.7  # the model card's 30.7B
    moe = spec_from_config({"model_type": "gemma4", "text_config": TEXT_26B})
    assert (moe.moe.experts, moe.moe.top_k, moe.moe.width, moe.moe.aux_coef) == (128, 8, 704, 0.0)
    # 25.2B, 3.8B active (the model card's "26B A4B")
    assert round(moe.num_params / 1e9, 1) == 25.2 and round(moe.active_params / 1e9, 1) == 3.8


@pytest.mark.parametrize("extra,match", [
    ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input = 256"),
    ({"num_kv_shared_layers": 20}, "num_kv_shared_layers = 20"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention = 'all'"),
    ({"per_layer_config": {"5": {"intermediate_size": 4096}}}, "intermediate_size for layer 5"),
], ids=["per_layer_inputs", "kv_sharing", "bidirectional", "per_layer_mlp"])
def test_what_is_not_trained_is_refused_with_its_key(extra, match, tmp_path):
    with pytest.raises(UserError, match=match):
        spec_from_config(TEXT_31B | extra, tmp_path / "config.json")


def test_per_layer_inputs_are_refused_where_the_default_turns_them_on(tmp_path):
    """Gemma4TextConfig's hidden_size_per_layer_input is 256: a config.json without it has
    per-layer inputs (E2B's and E4B's configs name it; 31B's and 26B-A4B's set 0)."""
    text = {k: v for k, v in TEXT_31B.items() if k != "hidden_size_per_layer_input"}
    with pytest.raises(UserError, match="per-layer input"):
        spec_from_config(text, tmp_path / "config.json")


def test_gguf_export_writes_the_gemma4_architecture(tiny_model_factory, tmp_path):
    """GGUF export is llama.cpp's gemma4 (round trips and llama.cpp's logits:
    tests/engine/gguf/test_gguf_families.py and test_llama_cpp.py)."""
    gguf = pytest.importorskip("gguf")
    from slideformer.engine.gguf.exporter import export_gguf
    f = export_gguf(tiny_model_factory("gemma4_text"), tmp_path / "m.gguf")
    assert gguf.GGUFReader(f).fields["general.architecture"].contents() == "gemma4"


# ---- the soft cap -------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_cross_entropy_with_a_soft_cap_equals_autograd(chunk):
    g = torch.Generator().manual_seed(0)
    h, w = 3 * torch.randn(23, 16, generator=g), torch.randn(50, 16, generator=g)
    y = torch.randint(0, 50, (23,), generator=g)
    y[::4] = -100
    cap = 2.0  # logits up to ~40: deep in the tanh's bend
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference_linear_cross_entropy(hr, wr, y, 0.3, softcap=cap)
    ref.backward()
    gw = torch.zeros(50, 16)
    loss, gh = linear_ce_fwd_bwd(h, w, y, 0.3, chunk, gw, softcap=cap)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(gh, hr.grad)
    torch.testing.assert_close(gw, wr.grad)
    rows = linear_ce_rows(h, w, y, chunk, softcap=cap)
    torch.testing.assert_close(rows.sum() * 0.3, ref.detach())
    torch.testing.assert_close(linear_ce_loss(h, w, y, chunk, softcap=cap) * 0.3, ref.detach())
    assert not torch.allclose(linear_ce_loss(h, w, y, chunk), linear_ce_loss(h, w, y, chunk,
                                                                             softcap=cap))


class _KernelStandIn:
    """triton_ce's two entry points in PyTorch (what the kernel computes, module docstring
    there): the Triton path's own code around the kernel then runs on the CPU."""

    @staticmethod
    def ce_grad_rows_(z, y, scale):
        zf, valid = z.float(), y != -100
        lse = torch.logsumexp(zf, dim=-1)
        loss = torch.where(valid, lse - zf.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
        dz = torch.softmax(zf, dim=-1)
        dz[torch.arange(len(y)), y.clamp(min=0)] -= 1.0
        z.copy_(dz * torch.where(valid, scale, 0.0)[:, None])
        return loss

    @staticmethod
    def ce_loss_rows(z, y):
        return torch.nn.functional.cross_entropy(z.float(), y, ignore_index=-100,
                                                 reduction="none")


def test_the_triton_paths_chain_rule_around_the_kernel(monkeypatch):
    """The soft cap on the Triton path (kernel over the capped logits, then dL/dz = dL/ds *
    (1 - t^2) over its output, per-token weights too) equals the PyTorch path, the kernel
    stood in for (the kernel itself: the gpu test below)."""
    from slideformer.engine.kernels import linear_ce
    from slideformer.engine.kernels.linear_ce import _chunk_grads, _chunk_grads_torch
    monkeypatch.setattr(linear_ce, "_triton_ce", lambda: _KernelStandIn)
    g = torch.Generator().manual_seed(2)
    h, w = 3 * torch.randn(17, 16, generator=g), torch.randn(40, 16, generator=g)
    y = torch.randint(0, 40, (17,), generator=g)
    y[::3] = -100
    for scale in (0.3, torch.rand(17, generator=g)):
        loss, dz = _chunk_grads(h, w, y, scale, use_triton=True, softcap=2.0)
        ref_loss, ref_dz = _chunk_grads_torch(h, w, y, 1.0, softcap=2.0)
        ref_dz = ref_dz * (scale[:, None] if isinstance(scale, torch.Tensor) else scale)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(dz, ref_dz)
    torch.testing.assert_close(linear_ce_loss(h, w, y, 5, use_triton=True, softcap=2.0),
                               linear_ce_loss(h, w, y, 5, use_triton=False, softcap=2.0))


def test_the_tiny_models_cap_bends_its_logits(tiny_model_factory, load_dense):
    """The tiny Gemma 4's cap (0.5) changes its logits: the checks against transformers are
    not vacuous."""
    capped = load_dense(tiny_model_factory("gemma4_text"))
    plain = DenseModel(dataclasses.replace(capped.spec, logit_softcap=None))
    plain.load_state_dict(capped.state_dict())
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = capped.logits(ids), plain.logits(ids)
    assert ((a - b).abs().max() / b.abs().max()).item() > 0.05
    assert a.abs().max() < 0.5


# ---- the multimodal folder ----------------------------------------------------------------
@pytest.fixture(scope="module")
def multimodal(tiny_model_factory, tmp_path_factory):
    """A tiny Gemma4ForConditionalGeneration (a one-layer vision tower, experts beside the
    MLPs) saved by transformers, with the tiny Gemma 4 tokenizer."""
    src = tiny_model_factory("gemma4_text", TinyShape(), {"enable_moe_block": True})
    text = json.loads((src / "config.json").read_text())
    text.pop("architectures")
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=16)
    special = dict(image_token_id=383, boi_token_id=382, eoi_token_id=381, video_token_id=380,
                   audio_token_id=379, boa_token_id=378, eoa_token_index=377)
    cfg = transformers.Gemma4Config(text_config=transformers.Gemma4TextConfig(**text),
                                    vision_config=vision, audio_config=None, **special)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gemma4-mm") / "model"
    transformers.Gemma4ForConditionalGeneration(cfg).eval().save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, out / f)
    return out


def test_text_tower_logits_equal_transformers(multimodal, load_dense):
    cfg = json.loads((multimodal / "config.json").read_text())
    assert cfg["model_type"] == "gemma4" and "per_layer_config" in cfg["text_config"]
    ours = load_dense(multimodal)
    # the multimodal model's tying decides (its text_config says untied)
    assert ours.spec.model_type == "gemma4_text" and ours.spec.tie_word_embeddings
    assert ours.spec.moe is not None and ours.spec.attn_shapes
    ref = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        multimodal, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager").eval()
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours.logits(ids), ref(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_export_is_a_text_only_gemma4(multimodal, load_dense, tmp_path):
    model = load_dense(multimodal)
    tensors = ((name, t) for item, flat, layout in model.items()
               for name, t in stored_views(model.spec, item, layout.views(flat)))
    out = write_hf_folder(tmp_path / "out", model.spec, tensors, dtype=torch.float32,
                          tokenizer_dir=multimodal)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_text" and cfg["architectures"] == ["Gemma4ForCausalLM"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager").eval()
    assert type(ref).__name__ == "Gemma4ForCausalLM"
    ids = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model.logits(ids), ref(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


# ---- on the GPU ---------------------------------------------------------------------------
def _cuda(test):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


@_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_soft_capped_triton_cross_entropy_matches_the_torch_path(dtype):
    """The Triton kernel over the capped logits, then the chain rule over its output, against
    the PyTorch path: loss, dL/dh and dL/dW, per-token weights included."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    h = (3 * torch.randn(300, 64, generator=g)).to("cuda", dtype)
    w = torch.randn(32000, 64, generator=g).to("cuda", dtype) / 8
    y = torch.randint(0, 32000, (300,), generator=g).cuda()
    y[::5] = -100
    for scale in (0.37, torch.rand(300, generator=g).cuda()):
        out = {}
        for triton in (True, False):
            gw = torch.zeros(32000, 64, device="cuda")
            loss, gh = linear_ce_fwd_bwd(h, w, y, scale, 128, gw, use_triton=triton, softcap=3.0)
            rows = linear_ce_rows(h, w, y, 128, use_triton=triton, softcap=3.0)
            out[triton] = (loss, gh, gw, rows)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for a, b in zip(out[True], out[False]):
            err = (a.float() - b.float()).abs().max() / b.float().abs().max()
            assert err.item() < tol


@_cuda
@pytest.mark.parametrize("hd", [256, 512])
def test_packed_rows_take_gemma4s_head_sizes(hd):
    """Packed rows of both head sizes (sliding 256, full 512 in the releases): the 256 heads go
    through FlexAttention BlockMasks, the 512 heads (beyond FlexAttention's shared memory on
    Hopper) through the boolean mask; output and gradients equal the boolean mask's."""
    from slideformer.engine.kernels.attention import (attend, document_block_mask,
                                                      document_mask, flex_available,
                                                      packed_causal_mask)
    doc = (torch.arange(8, device="cuda") >= 3).long()[None]
    assert isinstance(document_mask(doc, hd), torch.Tensor) == (not flex_available("cuda", hd))
    assert not flex_available("cuda", 512)
    if not flex_available("cuda", hd):
        return  # the boolean mask is the reference below: nothing more to compare
    g = torch.Generator("cuda").manual_seed(1)
    T = 384
    q = torch.randn(1, 4, T, hd, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(1, 2, T, hd, generator=g, device="cuda").to(torch.bfloat16)
            for _ in range(2))
    gy = torch.randn(1, 4, T, hd, generator=g, device="cuda").to(torch.bfloat16)
    doc = (torch.arange(T, device="cuda") >= T // 3).long()[None]
    out = []
    for mask in (document_block_mask(doc, None), packed_causal_mask(doc, None)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = attend(*leaves, mask, False, True)
        y.backward(gy)
        out.append((y, *(t.grad for t in leaves)))
    for a, b in zip(*out):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2


@_cuda
def test_cuda_bf16_training_follows_the_cpu(tiny_model_factory):
    """The sliding executor on CUDA in bf16 (grouped experts of one gate-and-up projection,
    FlexAttention masks of two head sizes over packed rows, the capped Triton cross-entropy)
    takes the steps the CPU takes in fp32, to bf16's rounding."""
    from slideformer.engine.config import OptimConfig
    from slideformer.engine.models.spec import load_spec
    from slideformer.engine.runtime.backend import CpuBackend, CudaBackend
    from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
    from slideformer.engine.runtime.host_state import AdamHyper
    from slideformer.engine.train.state import build_host_state, load_weights
    from tests.engine.runtime.test_sliding_equivalence import make_batches
    folder = tiny_model_factory("gemma4_text", TinyShape(hidden=128, heads=4, kv_heads=2,
                                                         intermediate=256),
                                {"enable_moe_block": True, "final_logit_softcapping": 1.0})
    spec = load_spec(folder)
    steps = make_batches(spec, n_micro=2, B=2, T=64, seed=4, packed=True)[:3]
    optim = OptimConfig(lr=1e-3, max_grad_norm=1.0)
    losses = {}
    steps = steps[:1] * 3  # one batch thrice: its loss must fall (different batches need not)
    for backend, dtype in ((CpuBackend(), torch.float32), (CudaBackend(), torch.bfloat16)):
        host = build_host_state(spec, backend, dtype, torch.float32, layer_grads=True)
        load_weights(host, spec, folder)
        ex = SlidingExecutor(spec, backend, host, ExecShape(micro_batch=2, seq_len=64, n_micro=2,
                                                            slots=2), dtype)
        losses[dtype] = [ex.train_step(mbs, lambda coef, k=k: AdamHyper(
            optim.lr, optim.beta1, optim.beta2, optim.eps, optim.weight_decay, k, coef),
            optim.max_grad_norm).loss for k, mbs in enumerate(steps, start=1)]
        ex.close()
        backend.release_host()
    torch.testing.assert_close(torch.tensor(losses[torch.bfloat16]),
                               torch.tensor(losses[torch.float32]), rtol=2e-2, atol=0)
    assert losses[torch.float32][-1] < losses[torch.float32][0]
