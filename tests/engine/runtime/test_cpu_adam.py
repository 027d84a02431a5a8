"""The host state's exact master split, and the compiled CPU AdamW against its PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.kernels import cpu_adam
from slideformer.engine.models.spec import Layout
from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, HostItem, adam_update, join_master, split_master


def test_split_is_exact_and_rounds_to_nearest():
    x = torch.randn(1 << 16) * torch.logspace(-20, 20, 1 << 16)
    w, r = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16)
    split_master(x.clone(), w, r)
    y = join_master(w, r, torch.empty_like(x))
    assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    # nearest: the bf16 copy is never more than half an ulp away (differs from RNE only on ties)
    assert ((w.float() - x).abs() <= (x.to(torch.bfloat16).float() - x).abs()).all()


def make_item(n, seed=0, moments=torch.float32):
    # odd sizes: runs start at odd offsets and end on odd counts (the kernel's edge cases)
    lay = Layout.build([("bias", (3,)), ("w", (n // 64, 63)), ("norm", (65,)), ("w2", (7, 5))])
    it = HostItem("x", lay, torch.bfloat16, moments, lambda k, d: torch.zeros(k, dtype=d),
                  lambda k, d: torch.zeros(k, dtype=d))
    g = torch.Generator().manual_seed(seed)
    it.set_master(torch.randn(lay.numel, generator=g) * 0.02)
    return it, g


@pytest.mark.skipif(not cpu_adam.native_available(), reason="no C compiler")
@pytest.mark.parametrize("coef,moments", [(1.0, torch.float32), (0.37, torch.float32),
                                          (0.37, torch.bfloat16)])
def test_native_update_matches_reference(coef, moments):
    a, g = make_item(1 << 16, moments=moments)
    b, _ = make_item(1 << 16, moments=moments)
    ws = AdamWorkspace()
    for step in range(1, 4):
        grad = torch.randn(a.numel, generator=g)
        a.g.copy_(grad)
        b.g.copy_(grad)
        hp = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, step, coef)
        adam_update(a, hp, ws, native=True)
        adam_update(b, hp, ws, native=False)
    ma, mb = a.master(), b.master()
    assert ((ma - mb).norm() / mb.norm()) < 1e-6
    tol = 1e-6 if moments == torch.float32 else 1e-4  # a last-bit fp32 difference can flip a bf16 rounding
    assert ((a.v.float() - b.v.float()).norm() / b.v.float().norm()) < tol
    if moments == torch.bfloat16:  # the same bf16 moments but where fp32 maths rounds apart
        assert (a.m != b.m).float().mean() < 1e-3 and (a.v != b.v).float().mean() < 1e-3
    assert not torch.equal(ma, make_item(1 << 16)[0].master())  # it did update


class _State:
    def __init__(self, item):
        self.w, self.rem = torch.empty_like(item.w), torch.empty_like(item.rem)
        self.m, self.v = torch.empty_like(item.m), torch.empty_like(item.v)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_update_into_other_buffers_equals_in_place_and_keeps_the_input(native, moments):
    """adam_update(out=...) (the speculative updates' second buffers) writes the bits an update
    in place writes, and leaves the item's own state as it was."""
    if native and not cpu_adam.native_available():
        pytest.skip("no C compiler")
    a, g = make_item(1 << 14, moments=moments)
    b, _ = make_item(1 << 14, moments=moments)
    a.g.copy_(torch.randn(a.numel, generator=g))
    b.g.copy_(a.g)
    before = [t.clone() for t in (a.w, a.rem, a.m, a.v)]
    out, ws = _State(a), AdamWorkspace()
    hp = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, 3, 0.5)
    adam_update(a, hp, ws, native=native, out=out)
    adam_update(b, hp, ws, native=native)
    for kept, now in zip(before, (a.w, a.rem, a.m, a.v)):
        assert torch.equal(kept, now)
    for new, ref in zip((out.w, out.rem, out.m, out.v), (b.w, b.rem, b.m, b.v)):
        assert torch.equal(new, ref)
    assert not torch.equal(out.w, a.w)  # it did update


@pytest.mark.skipif(not cpu_adam.native_available(), reason="no C compiler")
def test_update_into_other_buffers_refuses_another_alignment():
    a, _ = make_item(1 << 10)
    out = _State(a)
    with pytest.raises(ValueError, match="alignment"):
        cpu_adam.fused_update(*(t[1:-1] for t in (a.w, a.rem, a.g, a.m, a.v)), 1e-3, 0.9, 0.999,
                              1e-8, 0.0, 1, 1.0, out=[t[2:] for t in (out.w, out.rem, out.m, out.v)])
