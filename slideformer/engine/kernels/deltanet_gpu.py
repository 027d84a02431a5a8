"""The gated delta rule on CUDA: flash-linear-attention's chunked Triton kernels (``fla``).

``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (packages ``flash-linear-attention`` /
``fla-core``; not a dependency of this package) computes, per head, with q and k l2-normed in
the kernel (``use_qk_l2norm_in_kernel``) and q scaled by dk^-1/2:

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

on inputs (B, T, H, d) with g, beta (B, T, H), the same heads for q, k and v (older releases
have no grouped values: the caller repeats the key heads), an initial state (N, H, dk, dv) and
the final one in fp32. Packed documents are one row (1, sum T) with ``cu_seqlens`` (N + 1,) at
the documents' bounds, the FlashAttention varlen convention: every document starts from its
own initial state. It takes 16-bit q, k, v only (it asserts q is not fp32); fp32 stays on the
reference of ``models.deltanet``. Its backward is its own (an autograd Function).
"""
from __future__ import annotations

import functools

import torch

from slideformer.engine.kernels.dispatch import count_launch


@functools.cache
def _chunk_rule():
    """fla's ``chunk_gated_delta_rule``, or None where fla is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def fla_usable(v: torch.Tensor) -> bool:
    """Whether the rule on inputs like ``v`` takes fla's kernel: CUDA, 16-bit, fla importable,
    and not a GPU where fla's backward refuses to run (:func:`fla_refused_on`)."""
    return v.is_cuda and v.dtype in (torch.bfloat16, torch.float16) and \
        _chunk_rule() is not None and not fla_refused_on(v.device)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


@functools.cache
def fla_refused_on(device) -> bool:
    """fla (0.6) raises in the gated rule's backward on Hopper GPUs (compute capability 9.x)
    with Triton >= 3.4.0 and < 3.7.1 unless tilelang is installed: Triton miscompiles its
    ``chunk_bwd_dqkwg`` there (fla's issue 640). Measured on the reference H100 (torch 2.11,
    Triton 3.6.0): the first backward stops with that error. On such a machine the PyTorch
    chunked rule of models.deltanet runs instead (the same maths; measured there: Qwen3.5
    16-layer full fine-tune, benchmarks/RESULTS.md)."""
    import importlib.util
    try:
        import triton
    except ImportError:
        return False
    major = torch.cuda.get_device_capability(device)[0]
    bad = (3, 4, 0) <= _version(triton.__version__) < (3, 7, 1)
    return major == 9 and bad and importlib.util.find_spec("tilelang") is None


def fla_gated_delta_rule(q, k, v, g, beta, state=None, starts=None):
    """The rule through fla: (o (B, T, H, dv) in v's dtype, final state (B, H, dk, dv) in fp32,
    or None when ``state`` is None).

    q, k: (B, T, H, dk), not normalised (the kernel does it); v: (B, T, H, dv); g: (B, T, H)
    log decays in fp32; beta: (B, T, H); state: (B, H, dk, dv) or None (zeros, no final state);
    starts: (B, T) bool, True where a document begins (its state starts from zero), or None.
    With ``starts`` the rows become sequences of a varlen batch, ``state`` the initial state
    of each row's first one and the final state that of each row's last one.
    """
    rule = _chunk_rule()
    count_launch("fla_gated_delta_rule")
    if starts is None:
        return rule(q, k, v, g, beta, initial_state=state, output_final_state=state is not None,
                    use_qk_l2norm_in_kernel=True)
    B, T, H = v.shape[:3]
    first = starts.clone()
    first[:, 0] = True  # every row starts a sequence
    flat = first.reshape(-1)  # (B*T,)
    begins = flat.nonzero().squeeze(1)  # (N,) int64
    cu = torch.cat([begins, begins.new_tensor([B * T])])  # (N + 1,)
    seq = (flat.cumsum(0) - 1).view(B, T)  # sequence index of each token
    init = None
    if state is not None:
        init = state.new_zeros(len(begins), *state.shape[1:]).index_copy(0, seq[:, 0], state)
    o, last = rule(*(t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)),
                   initial_state=init, output_final_state=state is not None, cu_seqlens=cu,
                   use_qk_l2norm_in_kernel=True)
    return o.view(B, T, H, -1), (None if last is None else last[seq[:, -1]])
