"""DenseModel against Hugging Face transformers: logits and gradients on tiny random models.

Every family, odd sizes (hidden 96, 6 heads, 2 KV heads, intermediate 160), plus the variants
that change the maths: head_dim override, tied embeddings, llama3 and linear RoPE scaling,
attention/MLP biases, plain multi-head attention. Transformers runs with eager attention in fp32,
so the reference does not share our SDPA path.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from slideformer.engine.models.model import DenseModel
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.models.weights import hf_name

# llama3 scaling with original context 64: RoPE wavelengths for head_dim 16 / theta 1e4 are
# 6.3, 20, 63, 199, ... tokens, so the high (< 16), blended (16..64) and low (> 64) frequency
# bands are all exercised within a 19-token sequence.
LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
LINEAR_ROPE = {"rope_scaling": {"type": "linear", "factor": 4.0}}
# YaRN x4 from an original context of 64 on head_dim 16: the ramp spans dimensions 1.8 to 4.9
# of 8 (kept, blended and interpolated frequencies all present); the tables scale by 1.139.
YARN_ROPE = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "original_max_position_embeddings": 64},
             "max_position_embeddings": 256}

PHI4_ROPE = {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 16,
             "max_position_embeddings": 256,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 2.0, 3.0, 5.0],
                              "long_factor": [1.0, 1.5, 4.0, 9.0, 20.0, 40.0]}}

VARIANTS = [
    pytest.param("llama", TinyShape(), None, id="llama"),
    pytest.param("mistral", TinyShape(), None, id="mistral"),
    pytest.param("qwen2", TinyShape(), None, id="qwen2"),
    pytest.param("qwen3", TinyShape(), None, id="qwen3"),
    pytest.param("llama", TinyShape(head_dim=24), None, id="llama-head_dim24"),
    pytest.param("qwen3", TinyShape(head_dim=24), None, id="qwen3-head_dim24"),
    pytest.param("llama", TinyShape(tie=True), None, id="llama-tied"),
    pytest.param("qwen2", TinyShape(tie=True), None, id="qwen2-tied"),
    pytest.param("llama", TinyShape(), LLAMA3_ROPE, id="llama-rope_llama3"),
    pytest.param("llama", TinyShape(), LINEAR_ROPE, id="llama-rope_linear"),
    pytest.param("llama", TinyShape(), YARN_ROPE, id="llama-rope_yarn"),
    pytest.param("llama", TinyShape(), {"attention_bias": True, "mlp_bias": True},
                 id="llama-biases"),
    pytest.param("mistral", TinyShape(kv_heads=6), None, id="mistral-mha"),
    # sliding window 8 over 19-token rows: every query past the 8th loses keys
    pytest.param("mistral", TinyShape(), {"sliding_window": 8}, id="mistral-window8"),
    pytest.param("qwen2", TinyShape(), {"use_sliding_window": True, "sliding_window": 8,
                                        "max_window_layers": 2}, id="qwen2-window8-layers2+"),
    pytest.param("mixtral", TinyShape(), None, id="mixtral"),
    pytest.param("mixtral", TinyShape(), {"sliding_window": 8}, id="mixtral-window8"),
    pytest.param("qwen3_moe", TinyShape(), None, id="qwen3_moe"),
    pytest.param("qwen3_moe", TinyShape(), {"norm_topk_prob": False}, id="qwen3_moe-unnormed"),
    # layers of two shapes: dense MLPs (layer 0 named, every other by the step) among experts
    pytest.param("qwen3_moe", TinyShape(), {"mlp_only_layers": [0], "decoder_sparse_step": 2},
                 id="qwen3_moe-dense_layers"),
    pytest.param("olmo2", TinyShape(), None, id="olmo2"),
    pytest.param("olmoe", TinyShape(), None, id="olmoe"),
    pytest.param("olmoe", TinyShape(kv_heads=3), {"norm_topk_prob": True}, id="olmoe-gqa-normed"),
    pytest.param("olmo3", TinyShape(), None, id="olmo3"),
    pytest.param("smollm3", TinyShape(), None, id="smollm3"),
    pytest.param("phi3", TinyShape(), None, id="phi3"),
    pytest.param("phi3", TinyShape(), {"sliding_window": 8}, id="phi3-window8"),
    # Phi-4-mini's RoPE: 12 of 16 dimensions turn, LongRoPE from an original context of 16,
    # so 19-token rows take the long factors (and 8-token rows the short ones: below)
    pytest.param("phi3", TinyShape(), PHI4_ROPE, id="phi4-partial-rope_longrope"),
    pytest.param("gemma3_text", TinyShape(), None, id="gemma3"),
    # three gated DeltaNet layers and a gated full-attention layer with RoPE on 4 of 16 dims
    pytest.param("qwen3_5_text", TinyShape(), None, id="qwen3_5"),
    pytest.param("qwen3_5_text", TinyShape(layers=2), {"layer_types": [
        "full_attention", "linear_attention"], "attention_bias": True}, id="qwen3_5-full_first-bias"),
    pytest.param("qwen3_5_moe_text", TinyShape(), None, id="qwen3_5_moe"),
    # sinks, alternating window 8, YaRN, experts with biases and the clamped SwiGLU
    pytest.param("gpt_oss", TinyShape(), None, id="gpt_oss-rope_yarn"),
    pytest.param("gpt_oss", TinyShape(kv_heads=6), {"attention_bias": False,
                                                    "swiglu_limit": 0.05}, id="gpt_oss-mha-clamped"),
    pytest.param("gemma3_text", TinyShape(tie=False), {"rope_scaling": {
        "rope_type": "linear", "factor": 4.0}}, id="gemma3-untied-rope_linear"),
    # sliding layers (head 16, 2 KV heads, window 8) and full layers (head 32, 1 KV head, keys
    # as values, proportional RoPE on 4 of 16 frequency pairs); value norm, layer scalars,
    # logits soft-capped
    pytest.param("gemma4_text", TinyShape(), None, id="gemma4"),
    # experts top-2 of 4 beside the dense MLP of every layer
    pytest.param("gemma4_text", TinyShape(), {"enable_moe_block": True}, id="gemma4_moe"),
    # full layers with v_proj and the sliding layers' KV heads; a scaled proportional RoPE
    pytest.param("gemma4_text", TinyShape(tie=True), {
        "attention_k_eq_v": False, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                               "factor": 2.0, "rope_theta": 100000.0}}},
        id="gemma4-v_proj-tied-rope_proportional"),
]


def hf_as_ours(spec, tensors: dict) -> dict:
    """transformers' parameters (fused experts ``mlp.experts.gate_up_proj`` (E, 2I, H) and
    ``down_proj``, the router as ``mlp.gate``) under the engine's names (one stacked tensor
    per projection, under the family's checkpoint prefix)."""
    m = spec.family.moe
    if m is None or m.fused_stacked:  # GPT-OSS, Gemma 4: transformers' names and layout
        return tensors
    out = {}
    for name, t in tensors.items():
        base = name.rsplit(".mlp.", 1)[0]
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[f"{base}.{m.stacked(m.gate)}"], out[f"{base}.{m.stacked(m.up)}"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{base}.{m.stacked(m.down)}"] = t
        elif name.endswith(".mlp.gate.weight"):
            out[f"{base}.{m.router}"] = t
        else:
            out[name] = t
    return out


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def batch(vocab: int, B: int = 2, T: int = 19, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,shape,extra", VARIANTS)
def test_logits_match_transformers(arch, shape, extra, tiny_model_factory, load_dense, load_hf):
    folder = tiny_model_factory(arch, shape, extra)
    ours, ref = load_dense(folder), load_hf(folder)
    ids = batch(ours.spec.vocab_size)
    with torch.no_grad():
        err = rel_err(ours.logits(ids), ref(input_ids=ids).logits)
    assert err < 1e-4


@pytest.mark.parametrize("arch,shape,extra", [v for v in VARIANTS if "rope" in v.id])
def test_rope_scaling_is_applied(arch, shape, extra, tiny_model_factory, load_dense):
    """The scaled variants above would pass vacuously if the scaling did not change the logits."""
    scaled = load_dense(tiny_model_factory(arch, shape, extra))
    plain = DenseModel(dataclasses.replace(scaled.spec, rope_scaling=None))
    plain.load_state_dict(scaled.state_dict())
    ids = batch(scaled.spec.vocab_size)
    with torch.no_grad():
        assert rel_err(plain.logits(ids), scaled.logits(ids)) > 1e-3


def test_longrope_short_and_long_factors_follow_the_rows(tiny_model_factory, load_dense,
                                                         load_hf):
    """LongRoPE picks its factors per forward, by the rows' last position against the original
    context (16 here): rows of 8 tokens take the short factors, rows of 19 the long ones;
    both equal transformers, and the two sets give different logits on the same 8 tokens."""
    folder = tiny_model_factory("phi3", TinyShape(), PHI4_ROPE)
    ours, ref = load_dense(folder), load_hf(folder)
    ids = batch(ours.spec.vocab_size)
    with torch.no_grad():
        for T in (8, 16, 17, 19):
            assert rel_err(ours.logits(ids[:, :T]), ref(input_ids=ids[:, :T]).logits) < 1e-4
        short, long_ = ours.logits(ids[:, :8]), ours.logits(ids)[:, :8]
    assert rel_err(short, long_) > 1e-3


@pytest.mark.parametrize("arch,shape,extra", VARIANTS)
def test_gradients_match_transformers(arch, shape, extra, tiny_model_factory, load_dense,
                                      load_hf):
    folder = tiny_model_factory(arch, shape, extra)
    ours, ref = load_dense(folder), load_hf(folder)
    ids = batch(ours.spec.vocab_size, seed=1)
    hf_labels = ids.clone()  # HF convention: the model shifts, position t predicts labels[t+1]
    hf_labels[0, :6] = -100  # a masked prompt
    hf_labels[1, 11] = -100
    labels = torch.cat([hf_labels[:, 1:], torch.full_like(hf_labels[:, :1], -100)], dim=1)
    n = int((labels != -100).sum())

    # chunk=5 splits the 38 tokens into chunks, one of them fully masked
    loss = ours.loss(ids, labels, scale=1.0 / n, chunk=5)
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=hf_labels).loss
    ref_loss.backward()
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-5

    ref_grads = hf_as_ours(ours.spec, {name: p.grad for name, p in ref.named_parameters()})
    ours_grads = {hf_name(item, local): g for item, flat, layout in ours.items()
                  for local, g in layout.views(flat.grad).items()}
    buffers = {n for n in ours_grads if n.endswith(".layer_scalar")}  # Gemma 4's: not trained
    assert all(not ours_grads.pop(n).any() for n in buffers)
    assert ours_grads.keys() == ref_grads.keys()
    errors = {name: rel_err(g, ref_grads[name]) for name, g in ours_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("arch,shape,extra", [
    v for v in VARIANTS if v.id in ("llama-rope_llama3", "qwen2-tied", "qwen3-head_dim24",
                                    "mixtral", "qwen3_moe", "gemma3", "smollm3",
                                    "gpt_oss-rope_yarn", "gemma4_moe")])
def test_folder_saved_by_transformers(arch, shape, extra, tiny_model_factory, tmp_path,
                                      load_dense, load_hf):
    """A folder written by save_pretrained: its config spelling (transformers 5 moves
    rope_scaling into rope_parameters, Gemma's RoPE per layer type, Gemma 4's full layers'
    heads as per_layer_config), its sharding, its tied-weight omissions, experts saved one
    tensor each (their checkpoints' names)."""
    src = tiny_model_factory(arch, shape, extra)
    ref = load_hf(src)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_dense(tmp_path / "hf")
    assert ours.spec.rope_scaling == load_spec(src).rope_scaling
    ids = batch(ours.spec.vocab_size)
    with torch.no_grad():
        assert rel_err(ours.logits(ids), ref(input_ids=ids).logits) < 1e-4


def test_packed_documents_equal_separate_runs(tiny_model, load_dense):
    """Two documents in one row (doc_ids) give the logits, loss and gradients of separate runs."""
    model = load_dense(tiny_model)
    ids = batch(model.spec.vocab_size, T=24, seed=2)
    cuts = (9, 15)  # row b holds tokens [0, cut) of one document and [cut, 24) of another
    doc_ids = torch.stack([(torch.arange(24) >= c).long() for c in cuts])
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    for b, c in enumerate(cuts):
        labels[b, c - 1] = -100  # no target across the boundary

    with torch.no_grad():
        packed = model.logits(ids, doc_ids)
        unmasked = model.logits(ids)
        for b, c in enumerate(cuts):
            assert rel_err(packed[b, :c], model.logits(ids[b:b + 1, :c])[0]) < 1e-5
            assert rel_err(packed[b, c:], model.logits(ids[b:b + 1, c:])[0]) < 1e-5
            # without doc_ids the second document sees the first one: the check is not vacuous
            assert rel_err(unmasked[b, c:], packed[b, c:]) > 1e-3

    model.loss(ids, labels, 1.0, doc_ids).backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    separate = sum(model.loss(ids[b:b + 1, s], labels[b:b + 1, s], 1.0)
                   for b, c in enumerate(cuts) for s in (slice(0, c), slice(c, None)))
    separate.backward()
    for g_packed, p in zip(packed_grads, model.parameters()):
        assert rel_err(g_packed, p.grad) < 1e-5


def test_grouped_matmul_operands_are_moved_to_aligned_memory_only_when_they_are_not():
    """torch's grouped matmul takes 16-byte aligned operands only; a stacked expert tensor is a
    view of its layer's flat buffer at wherever the tensors before it end (tiny models: any
    offset), so a misaligned one is copied with its strides, an aligned one used in place."""
    from slideformer.engine.models.moe import _aligned
    flat = torch.zeros(8 + 4 * 6 * 8, dtype=torch.bfloat16)
    odd = flat[1:1 + 4 * 6 * 8].view(4, 6, 8).transpose(-2, -1)  # 2 bytes past aligned
    assert odd.data_ptr() % 16 and _aligned(odd).data_ptr() % 16 == 0
    assert _aligned(odd).stride() == odd.stride() and torch.equal(_aligned(odd), odd)
    even = flat[8:8 + 4 * 6 * 8].view(4, 6, 8)
    assert even.data_ptr() % 16 == 0 and _aligned(even) is even
