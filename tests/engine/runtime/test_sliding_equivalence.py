"""Sliding-window training equals plain dense training (CPU, fp32), step by step."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from slideformer.engine.config import OptimConfig
from slideformer.engine.kernels.attention import packed_causal_mask
from slideformer.engine.models.layers import decoder_layer, rms_norm, rope_tables
from slideformer.engine.models.model import positions_for
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.models.weights import Checkpoint, item_layout, item_names
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.updates import OrderedWorker
from slideformer.engine.train.schedule import lr_at
from slideformer.engine.train.state import build_host_state, load_weights

STEPS = 5


@dataclass
class MB:
    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor | None


def make_batches(spec, n_micro, B=2, T=24, seed=0, packed=False):
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        mbs = []
        for _ in range(n_micro):
            ids = torch.randint(0, spec.vocab_size, (B, T), generator=g)
            labels = torch.randint(0, spec.vocab_size, (B, T), generator=g)
            labels[torch.rand(B, T, generator=g) < 0.3] = -100
            doc = None
            if packed:
                doc = (torch.arange(T) >= T // 3).long().expand(B, T).clone()
                labels[:, T // 3 - 1] = -100
            mbs.append(MB(ids, labels, doc))
        steps.append(mbs)
    return steps


class DenseReference:
    """Per-tensor leaves, torch.optim.AdamW (decay on matrices only), clip_grad_norm_.

    ``autocast``: the forward under torch.autocast(bfloat16) (standard mixed precision on the
    fp32 model); ``residual``: a dtype the residual stream is rounded to after the embedding and
    each layer (benchmarks/precision.py's diagnosis).
    """

    def __init__(self, spec, model_dir, optim: OptimConfig, autocast: bool = False,
                 residual: torch.dtype | None = None):
        self.spec, self.optim = spec, optim
        self.autocast, self.residual = autocast, residual
        ck = Checkpoint(model_dir)
        self.items = {}
        for item in item_names(spec):
            buf = ck.read_item(spec, item, torch.empty(item_layout(spec, item).numel))
            self.items[item] = {k: torch.nn.Parameter(v.clone())
                                for k, v in item_layout(spec, item).views(buf).items()}
        params = [p for d in self.items.values() for p in d.values()]
        groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": optim.weight_decay},
                  {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                     eps=optim.eps)
        self.params = params

    def loss(self, mb, scale):
        s = self.spec
        x = self._round(torch.nn.functional.embedding(mb.input_ids, self.items["embed"]["embed_tokens.weight"]))
        rope = rope_tables(s, positions_for(mb.input_ids, mb.doc_ids), x.dtype)
        mask = None if mb.doc_ids is None else packed_causal_mask(mb.doc_ids)
        for i in range(s.num_layers):
            x = self._round(decoder_layer(s, self.items[f"layer{i}"], x, rope, mask))
        h = rms_norm(x, self.items["head"]["norm.weight"], s.rms_norm_eps)
        w = (self.items["embed"]["embed_tokens.weight"] if s.tie_word_embeddings
             else self.items["head"]["lm_head.weight"])
        z = (h @ w.t()).float()  # fp32 logits for the loss, as Hugging Face models do
        return torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), mb.labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum") * scale

    def _round(self, x):
        return x if self.residual is None else x.to(self.residual).to(x.dtype)

    def step(self, mbs, step, total):
        tokens = sum(int((mb.labels != -100).sum()) for mb in mbs)
        self.opt.zero_grad()
        loss = 0.0
        for mb in mbs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                l_mb = self.loss(mb, 1.0 / tokens)
            l_mb.backward()
            loss += l_mb.item()
        if self.optim.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.optim.max_grad_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, total, self.optim)
        self.opt.step()
        return loss

    def flat(self, item):
        return torch.cat([p.detach().reshape(-1) for p in self.items[item].values()])


def run_sliding(spec, model_dir, steps, optim, shape, threaded=False):
    """``threaded``: updates in a worker thread as on CUDA (the CPU backend runs them inline)."""
    backend = CpuBackend()
    host = build_host_state(spec, backend, torch.float32, torch.float32,
                            layer_grads=optim.max_grad_norm > 0)
    load_weights(host, spec, model_dir)
    ex = SlidingExecutor(spec, backend, host, shape, torch.float32)
    if threaded:
        ex.updater = OrderedWorker()  # the worker CUDA runs
    losses = []
    for k, mbs in enumerate(steps, start=1):
        hyper = lambda coef, k=k: AdamHyper(lr_at(k, STEPS, optim), optim.beta1, optim.beta2,  # noqa: E731
                                            optim.eps, optim.weight_decay, k, coef)
        losses.append(ex.train_step(mbs, hyper, optim.max_grad_norm).loss)
    ex.close()
    return losses, host


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def family_model(request, tmp_path_factory):
    arch = request.param
    shape = TinyShape(layers=4, tie=(arch == "qwen2"))
    d = make_tiny_model(tmp_path_factory.mktemp(arch) / "m", arch, shape, seed=1)
    return load_spec(d), d


OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, schedule="cosine", warmup_steps=2,
                    max_grad_norm=0.5)


def assert_same(spec, ref, ref_losses, losses, host):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for item in item_names(spec):
        a, b = host[item].master(), ref.flat(item)
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 1e-5, f"{item}: relative difference {rel:.2e}"


def test_family_matches_dense(family_model):
    """K=2 of 4 layers, 2 micro-batches, clipping on: losses and weights match dense AdamW."""
    spec, d = family_model
    steps = make_batches(spec, n_micro=2)[:1] * STEPS  # one batch, seen 5 times: loss must fall
    ref = DenseReference(spec, d, OPTIM)
    ref_losses = [ref.step(mbs, k, STEPS) for k, mbs in enumerate(steps, start=1)]
    losses, host = run_sliding(spec, d, steps, OPTIM,
                               ExecShape(micro_batch=2, seq_len=24, n_micro=2, slots=2))
    assert_same(spec, ref, ref_losses, losses, host)
    assert ref_losses[-1] < ref_losses[0]  # the steps actually trained


@pytest.mark.parametrize("slots,n_micro,ckpt,clip,packed", [
    (1, 1, "gpu", 0.5, False), (3, 3, "host", 0.5, False), (4, 2, "gpu", 0.0, False),
    (2, 2, "host", 0.0, True), (6, 1, "gpu", 1e-3, True)])
def test_schedule_variants_match_dense(tmp_path, slots, n_micro, ckpt, clip, packed):
    """Varying K, micro-batches, checkpoint placement and clipping changes nothing."""
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=4), seed=2)
    spec = load_spec(d)
    optim = OptimConfig(lr=2e-3, weight_decay=0.05, schedule="linear", max_grad_norm=clip)
    steps = make_batches(spec, n_micro, B=1, T=20, seed=3, packed=packed)
    ref = DenseReference(spec, d, optim)
    ref_losses = [ref.step(mbs, k, STEPS) for k, mbs in enumerate(steps, start=1)]
    losses, host = run_sliding(spec, d, steps, optim,
                               ExecShape(micro_batch=1, seq_len=20, n_micro=n_micro, slots=slots,
                                         checkpoints=ckpt))
    assert_same(spec, ref, ref_losses, losses, host)


@pytest.mark.parametrize("gpu_checkpoints,regen", [(2, 0), (1, 4), (4, 0)])
def test_checkpoints_split_between_host_and_device_match_dense(tmp_path, gpu_checkpoints, regen):
    """Host checkpoints with the top layers' kept on the device (SplitStore; all four: the
    device store alone), with and without regenerated gradients: the same steps as dense."""
    from slideformer.engine.runtime.activations import DeviceStore, SplitStore
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=4), seed=2)
    spec = load_spec(d)
    optim = OptimConfig(lr=2e-3, weight_decay=0.05, schedule="linear", max_grad_norm=0.5)
    steps = make_batches(spec, 2, B=1, T=20, seed=3, packed=True)
    ref = DenseReference(spec, d, optim)
    ref_losses = [ref.step(mbs, k, STEPS) for k, mbs in enumerate(steps, start=1)]
    shape = ExecShape(micro_batch=1, seq_len=20, n_micro=2, slots=2, checkpoints="host",
                      gpu_checkpoints=gpu_checkpoints, regen_layers=regen)
    stores = []
    real = SlidingExecutor.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        stores.append(self.store)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SlidingExecutor, "__init__", spy)
        losses, host = run_sliding(spec, d, steps, optim, shape)
    assert isinstance(stores[0], SplitStore if gpu_checkpoints < 4 else DeviceStore)
    assert_same(spec, ref, ref_losses, losses, host)


def test_feed_forward_tiles_match_dense(tmp_path, monkeypatch):
    """Each layer's feed-forward half in tiles of 7 tokens of the 2 x 20 of a packed
    micro-batch (ExecShape.ff_tokens), and its recompute + backward in tiles of 3 query
    positions (rows of the boolean document mask: models.recompute.query_tiled_grads), clipping
    on: the same losses and weights as dense training."""
    from slideformer.engine.models import recompute
    calls = []
    real = recompute.query_tiled_grads
    monkeypatch.setattr(recompute, "query_tiled_grads", lambda *a, **k: calls.append(1) or real(*a, **k))
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=4), seed=6)
    spec = load_spec(d)
    optim = OptimConfig(lr=2e-3, weight_decay=0.05, schedule="linear", max_grad_norm=0.5)
    steps = make_batches(spec, 2, B=2, T=20, seed=7, packed=True)
    ref = DenseReference(spec, d, optim)
    ref_losses = [ref.step(mbs, k, STEPS) for k, mbs in enumerate(steps, start=1)]
    losses, host = run_sliding(spec, d, steps, optim,
                               ExecShape(micro_batch=2, seq_len=20, n_micro=2, slots=2,
                                         ff_tokens=7))
    assert_same(spec, ref, ref_losses, losses, host)
    assert len(calls) == spec.num_layers * 2 * len(steps), len(calls)  # every layer and micro-batch


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_5_text", "gpt_oss"])
def test_feed_forward_tiles_match_whole_micro_batches(tmp_path, arch):
    """The families whose sliding training tests/engine/models compares with transformers'
    (sandwich norms and sliding layers, the gated DeltaNet, experts with sinks): five steps with
    tiles of 7 tokens end where five steps without end (losses within 1e-5; weights within
    1e-4, the weights' difference from the run without tiles, relative to them)."""
    d = make_tiny_model(tmp_path / "m", arch, TinyShape(layers=4), seed=6)
    spec = load_spec(d)
    optim = OptimConfig(lr=2e-3, weight_decay=0.05, schedule="linear", max_grad_norm=0.5)
    steps = make_batches(spec, 2, B=2, T=20, seed=7)[:1] * STEPS  # one batch: the loss falls
    runs = [run_sliding(spec, d, steps, optim, ExecShape(micro_batch=2, seq_len=20, n_micro=2,
                                                         slots=2, ff_tokens=ff)) for ff in (0, 7)]
    (whole, host_w), (tiled, host_t) = runs
    torch.testing.assert_close(torch.tensor(tiled), torch.tensor(whole), rtol=1e-5, atol=0)
    assert whole[-1] < whole[0]
    for item in item_names(spec):  # AdamW's normalised steps magnify the summation order's
        a, b = host_t[item].master(), host_w[item].master()  # noise in tiny grads (~1e-5)
        assert ((a - b).norm() / b.norm()).item() < 1e-4, item


@pytest.mark.parametrize("ring,threaded", [(1, False), (2, True), (3, True)])
def test_gradient_ring_matches_dense(tmp_path, ring, threaded):
    """Without clipping the layers' gradients pass through a ring of fewer buffers than layers
    (here 1-3 for 4 layers), also with updates racing the backward in a worker thread."""
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=4), seed=4)
    spec = load_spec(d)
    optim = OptimConfig(lr=2e-3, weight_decay=0.05, schedule="linear", max_grad_norm=0.0)
    steps = make_batches(spec, 2, B=1, T=20, seed=5)
    ref = DenseReference(spec, d, optim)
    ref_losses = [ref.step(mbs, k, STEPS) for k, mbs in enumerate(steps, start=1)]
    losses, host = run_sliding(spec, d, steps, optim,
                               ExecShape(micro_batch=1, seq_len=20, n_micro=2, slots=2,
                                         grad_ring=ring), threaded=threaded)
    assert all(host[f"layer{i}"].g is None for i in range(4))
    assert_same(spec, ref, ref_losses, losses, host)


@pytest.mark.parametrize("device_layers,clip,threaded", [(0, 0.5, False), (1, 0.5, True),
                                                          (3, 0.0, True), (4, 1e-3, False)])
def test_device_updated_items_match_dense(tmp_path, device_layers, clip, threaded):
    """Embedding, head and the first layers updated where they live (the device) instead of
    by the host optimizer: the same steps as dense AdamW, and the host copy that checkpoints
    read is refreshed by drain()."""
    d = make_tiny_model(tmp_path / "m", "qwen3", TinyShape(layers=4), seed=6)
    spec = load_spec(d)
    optim = OptimConfig(lr=2e-3, weight_decay=0.05, schedule="linear", max_grad_norm=clip)
    steps = make_batches(spec, 2, B=1, T=20, seed=7)
    ref = DenseReference(spec, d, optim)
    ref_losses = [ref.step(mbs, k, STEPS) for k, mbs in enumerate(steps, start=1)]
    losses, host = run_sliding(spec, d, steps, optim,
                               ExecShape(micro_batch=1, seq_len=20, n_micro=2, slots=2,
                                         device_update=True, device_layers=device_layers),
                               threaded=threaded)
    assert_same(spec, ref, ref_losses, losses, host)

