"""Transient device memory of one training step: its inputs and hidden states, and the peak of
one decoder layer's forward and recompute + backward and of the LM head, per kernel path.

Each term mirrors the executor's own functions (SlidingExecutor.train_step, forward_window,
head_step, _layer_backward) and was checked against allocator traces of them
(tests/engine/plan/test_plan_memory.py on the CPU, tests/engine/plan/test_plan_memory_gpu.py on
CUDA); see slideformer.engine.plan.memory for how the phases combine into peaks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from slideformer.engine.kernels import fp8
from slideformer.engine.kernels.attention import FLASH_HEAD_DIM
from slideformer.engine.kernels.dispatch import KernelPath
from slideformer.engine.kernels.linear_ce import GW_ROWS
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.plan.allocation import Allocation, Precision
from slideformer.engine.runtime.shapes import ExecShape


@dataclass(frozen=True)
class FrozenBase:
    """What a frozen base (train.method lora / qlora) changes in a step's transients: a layer's
    backward computes its input and adapter grads only, the LM head dL/dx only."""
    grads: int
    """Bytes of one layer's adapter grads as autograd returns them, and their fp32 copy."""
    saved_per_token: int
    """Bytes per token the adapters add to the recompute's saved tensors: the output of each
    A (rank values), and with dropout each target's dropped input."""


def step_transients(spec: ModelSpec, shape: ExecShape, prec: Precision, kernels: KernelPath,
                    frozen: FrozenBase | None = None) -> list[Allocation]:
    """Tensors of one train_step: inputs, hidden states, and the peak of each part of the step,
    on the kernel path the run takes (slideformer.engine.kernels.dispatch.kernel_path), for a
    trained base or a ``frozen`` one."""
    r, H, n = prec.r, spec.hidden_size, shape.n_micro
    B, T = shape.micro_batch, shape.seq_len
    N = B * T  # tokens of one micro-batch
    mb = f"{n} micro-batches x {B}x{T}"
    packed = kernels.attention != "causal"
    ints = 3 if packed else 2  # input_ids, labels (+ doc_ids) as int64, per micro-batch on device
    rope = 2 * spec.max_head_dim * r  # rope_tables: cos, sin (B, 1, T, head_dim), residual dtype
    out = [Allocation("gpu", "inputs and RoPE tables", n * N * (8 * ints + rope), mb, "step")]
    if packed:
        out.append(attention_masks(shape, kernels))
    # The forward's outputs (xs), then the backward's gradients (gys), one per micro-batch; the
    # LM head makes the gradients while the outputs are still held (train_step drops them after).
    hidden = n * N * H * r
    out += [Allocation("gpu", "hidden states or their grads", hidden, f"{mb}x{H} x {r} B", "step"),
            Allocation("gpu", "hidden-state grads beside them", hidden, f"{mb}x{H} x {r} B", "head")]
    fwd, *bwd = layer_transients(spec, N, B, T, prec, kernels, frozen, shape.ff_tokens)
    head = head_scratch(spec, shape, prec, kernels.fused_ce, kernels.fused_ops, frozen is not None,
                        kernels.fp32_grads)
    out += [fwd, head, *bwd]
    if prec.fp8:
        out += fp8_operands(spec, N, shape.ff_tokens)
    return out


def fp8_operands(spec: ModelSpec, N: int, tile: int = 0) -> list[Allocation]:
    """kernels.fp8.rowwise's e4m3 copies of a feed-forward projection's operands (the Triton
    kernel writes them directly, 1 byte an element; the scales are a row's 4 bytes, left out), in
    the forward and in the backward: the widest input (the down projection's of N tokens or a
    feed-forward tile, or dL/dy of the gate and up) and the largest MLP matrix. Modelled from
    the code, not measured on a GPU."""
    if not spec.dense_mlp_width:  # experts only: nothing runs in FP8
        return []
    gate_up = 2 if spec.family.fused else 1  # Phi-3's fused gate-up: its dL/dy is 2 I wide
    rows = _ff_tokens(N, tile) * max(spec.hidden_size, spec.dense_mlp_width * gate_up)
    matrix = max((math.prod(s) for lay in set(spec.layouts) for n, _, s in lay.entries
                  if n.startswith(fp8.PROJECTIONS) and n.endswith("_proj.weight")
                  and "expert" not in n and len(s) == 2), default=0)
    b = rows + matrix
    what = f"a {rows:,}-element input and a {matrix:,}-element matrix, e4m3"
    return [Allocation("gpu", "FP8 operand copies", b, what, "forward"),
            Allocation("gpu", "FP8 operand copies (backward)", b, what, "backward")]


def attention_masks(shape: ExecShape, kernels: KernelPath) -> Allocation:
    """The document masks of a packed step, one per micro-batch: boolean (B, 1, T, T)
    (packed_causal_mask), or a FlexAttention BlockMask (attention.document_block_mask): int32
    block counts (B, 1, T/128) and block indices (B, 1, T/128, T/128) of the partial and the
    full blocks, by rows and by columns. Building a BlockMask evaluates the rule over a
    transient (B, 1, T, T) boolean before the forward, when nothing larger is held."""
    B, T, n = shape.micro_batch, shape.seq_len, shape.n_micro
    mb = f"{n} micro-batches x {B}x{T}"
    if kernels.attention == "flex":
        nb = -(-T // 128)
        return Allocation("gpu", "attention masks", n * B * 4 * (4 * nb * nb + 4 * nb),
                          f"{mb}: FlexAttention BlockMasks of {nb}x{nb} blocks (int32)", "step")
    return Allocation("gpu", "attention masks", n * B * T * T, f"{mb}x{T} (bool)", "step")


def layer_transients(spec: ModelSpec, N: int, B: int, T: int, prec: Precision,
                     kernels: KernelPath, frozen: FrozenBase | None = None,
                     tile: int = 0) -> list[Allocation]:
    """One decoder layer on one micro-batch: its forward scratch, then the recompute's
    activations and the layer's grads, on the PyTorch ops or the fused Triton ones, for a
    trained base or a ``frozen`` one, the feed-forward in tiles of ``tile`` tokens
    (ExecShape.ff_tokens; 0: none)."""
    masked = kernels.attention == "mask"
    into = kernels.fp32_grads and frozen is None and prec.c < 4
    # tiles of queries: "flash" (CUDA's fused kernels align causal rows to the bottom right)
    # or "mask" (a boolean mask for each tile: the CPU, and document masks)
    queries = (("mask" if masked or not kernels.cuda else "flash")
               if query_tiled(spec, kernels, T) else "")
    if kernels.fused_ops:
        out = [fused_forward_scratch(spec, N, B, T, prec, masked, tile),
               *fused_recompute_scratch(spec, N, B, T, prec, masked, frozen, into, tile, queries)]
    else:
        out = [forward_scratch(spec, N, B, T, prec, masked, tile),
               *recompute_scratch(spec, N, B, T, prec, masked, frozen, into, tile, queries)]
    tiled = queries and _ff_tokens(N, tile) < N
    if tiled:
        out = [replace(a, detail=f"{a.detail}, {tile:,} tokens of queries at a time")
               if a.purpose == "recompute activations" else a for a in out]
    fwd, bwd = math_scores(spec, B, T, kernels), math_scores(
        spec, B, T, kernels, max(1, tile // B) if tiled else T)
    if fwd:
        out = [replace(a, bytes=a.bytes + fwd) if a.purpose == "layer forward scratch" else
               replace(a, bytes=a.bytes + bwd) if a.purpose == "recompute activations" else a
               for a in out]
    return out


MATH_SCORE_BYTES = 14
"""Bytes per attention score (batch x heads x query rows x keys) at the peak of SDPA's math
path, its forward or its forward and backward: fp32 scores, their softmax, the dtype casts
and the causal mask, with 16-bit inputs (allocator peaks on the CPU with the math backend
forced, heads of 512, 4K positions: 13.5 and 14.0 bytes; more at 1K-2K, where q, k and v
weigh more beside the scores; tests/engine/plan/test_plan_memory.py)."""


def math_scores(spec: ModelSpec, B: int, T: int, kernels: KernelPath, rows: int | None = None) -> int:
    """The scores SDPA's math path keeps for a layer whose heads are wider than its fused
    kernels take (kernels.attention.FLASH_HEAD_DIM) on CUDA, for ``rows`` query positions of
    each of B rows over T keys (default: all T); 0 when no layer is that wide."""
    if not kernels.cuda or spec.max_head_dim <= FLASH_HEAD_DIM:
        return 0
    return MATH_SCORE_BYTES * B * spec.num_heads * (T if rows is None else rows) * T


def query_tiled(spec: ModelSpec, kernels: KernelPath, T: int) -> bool:
    """Whether a tiled layer's backward tiles its queries (models.recompute.query_tiles) in every
    layer of the model, for rows of T positions: attention with its own q, k, v projections and
    no sinks in every layer (no gated DeltaNet), plain causal rows or a boolean mask, not a
    FlexAttention BlockMask: neither packed documents on the Flex path, nor sliding layers
    whose window is shorter than the rows (their mask is then a BlockMask on CUDA; counted
    untiled everywhere, which errs high on the CPU)."""
    window = spec.sliding_window is not None and spec.sliding_window < T
    return (kernels.attention != "flex" and not window and not spec.family.fused
            and not spec.family.sinks and not any(spec.is_linear(i) for i in range(spec.num_layers)))


def _ff_tokens(N: int, tile: int) -> int:
    """Tokens whose feed-forward intermediates are alive at once (models.layers.tiles)."""
    return min(N, tile) if tile else N


def forward_scratch(spec: ModelSpec, N: int, B: int, T: int, prec: Precision, masked: bool,
                    tile: int = 0) -> Allocation:
    """decoder_layer without autograd, one micro-batch, PyTorch ops: SwiGLU's gate, up, silu and
    product (N x I each) next to the residual and its norm (in the residual dtype); or RMSNorm's
    fp32 temporaries. ``masked``: attention takes a boolean document mask. In tiles of ``tile``
    tokens: a tile's intermediates (and its output) beside the whole mid residual and the
    layer's output buffer."""
    c, H, I = prec.c, spec.hidden_size, spec.ffn_width
    t = _ff_tokens(N, tile)
    mlp = t * ((4 * I + H) * c + H * prec.r) + (N * H * prec.r * 2 if t < N else 0)
    norm = N * H * (c + 12)  # x, and x.float(), its square, the normalised fp32 copy
    mask = B * T * T * c if masked else 0  # SDPA turns the bool mask into an additive one
    # attention, which tiles leave the peak to: the normed input, rotated q, k and v, the output
    # and its (B, T, H) copy; with grouped KV heads 2 q c more per token: not a copy SDPA makes
    # (enable_gqa repeats nothing) but an allowance for the CPU flash kernel's fp32 scratch, which
    # it matched in the fp32 test case (the 16-bit cases are strict xfails in test_plan_memory)
    q, kv = spec.q_width, spec.kv_width
    attn = N * (H * c + 2 * q * c + 2 * kv * c + (2 * q * c if q > kv else 0) + 4 * spec.num_heads)
    return Allocation("gpu", "layer forward scratch", max(mlp, norm, attn) + mask,
                      f"one micro-batch of {N:,} tokens, one layer, no autograd", "forward")


def head_scratch(spec: ModelSpec, shape: ExecShape, prec: Precision, fused_ce: bool = False,
                 fused_norm: bool = False, frozen: bool = False, fp32_grads: bool = False) -> Allocation:
    """head_step for one micro-batch: RMSNorm with autograd, dL/dh, and one chunk of
    linear_ce_fwd_bwd: logits in the compute dtype and fp32, their softmax-gradient in fp32 and
    in the compute dtype (the Triton kernel: only the logits, overwritten by dz), or later dz
    next to one row block of the head-gradient product and its upcast. ``fused_norm``: the
    Triton RMSNorm, which keeps only its output and one fp32 rsqrt per token. ``frozen``: the
    head of a frozen base, whose loss computes no dL/dW (no row blocks of its product).
    ``fp32_grads``: dL/dW accumulates inside the matmul (linear_ce.fp32_accumulate): no row
    blocks either, only dz. Soft-capped logits (ModelSpec.logit_softcap) keep tanh(z / cap) in
    the compute dtype beside them."""
    c, H, V = prec.c, spec.hidden_size, spec.vocab_size
    N = shape.micro_batch * shape.seq_len
    nc = min(shape.head_chunk, N)
    up = 4 if c < 4 else 0  # .float() copies only when the compute dtype is narrower
    softmax = nc * V * (c if fused_ce else 8 + (c if c < 4 else 0))
    if N > nc:  # the previous chunk's dz is still bound while the next one is computed
        softmax += nc * V * c
    if spec.logit_softcap is not None:  # tanh(z / cap) beside the capped logits (Gemma 4;
        softmax += nc * V * (c if fused_ce else c + 8)  # PyTorch: fp32 1 - tanh^2 made of it)
    rows = min(V, GW_ROWS)  # linear_ce._add_outer: one block of vocabulary rows at a time
    wgrad = 0 if frozen else nc * V * c + (0 if fp32_grads else rows * H * (c + up))
    # 8 B per element: the norm's saved fp32 values and its output or gh (head_step frees each
    # micro-batch's h and gh before the next one's: one N x H x c less than while the loop kept
    # them, measured on the CPU allocator 2026-12-06); an fp32 stream needs no copy but keeps
    # the fp32 normalised value and the rounded output
    norm = N * H * (4 + 2 * c if prec.wide else 8)
    if fused_norm:  # h and gh, the rsqrt per token; its input is the hidden state itself
        norm = N * (2 * H * c + 4)
    return Allocation("gpu", "LM-head chunk and loss", norm + max(softmax, wgrad),
                      f"{nc:,} tokens x {V:,} vocab per chunk, fp32 softmax", "head")


def recompute_scratch(spec: ModelSpec, N: int, B: int, T: int, prec: Precision,
                      masked: bool, frozen: FrozenBase | None = None,
                      into: bool = False, tile: int = 0, queries: str = "") -> list[Allocation]:
    """_layer_backward for one micro-batch, PyTorch ops: the recompute's saved activations and
    the grads (``masked``: attention takes a boolean document mask).

    The peak is at the MLP's backward (all activations saved, the down-projection's weight grad
    and three N x I grads alive) for long micro-batches; for short ones at the input norm's
    backward or at the end (every parameter grad of the layer in the compute dtype, returned at
    once by autograd.grad, plus dL/dx). models.recompute.layer_backward never forms the layer's
    output.
    Saved per token: the two RMSNorms (their fp32 input copy when the compute dtype is narrower,
    normalised value and output); rotated q, attention output (2 per q element),
    rotated k and v (2 per kv element); gate, up, silu (3 per I) and their three grads; the
    attention log-sum-exp (fp32 per head) and the norms' rsqrt (fp32). A wider residual stream
    widens the mid-layer residual and, with QK-norm, the normed q and k ahead of fp32 RoPE.
    A ``frozen`` base's recompute runs decoder_layer under autograd (the adapters' grads), so
    the output exists; its norms save no normalised value (their weights need no grad).
    """
    c, H, I, P = prec.c, spec.hidden_size, spec.ffn_width, spec.params_per_layer
    q, kv = spec.q_width, spec.kv_width  # the widest layer's (Gemma 4's full layers)
    norms = (4 if c < 4 else 0) + 4 + 4 * c  # per H element: norm1, norm2
    qk = (q + kv) * ((4 if c < 4 else c) + c) if spec.qk_norm else 0
    wide = (H + (q + kv if spec.qk_norm else 0)) * (prec.r - c)
    out = 0 if frozen is None else prec.r  # per H element: the frozen recompute's output
    if frozen is not None:
        norms -= 2 * c
    ff = H * norms // 2 + 6 * I * c  # the feed-forward's share: its norm, the MLP's
    per_token = (H * (norms + out) + 2 * q * c + 2 * kv * c + 6 * I * c + qk + wide
                 + 4 * spec.num_heads + 8)
    mask = B * T * T * c if masked else 0
    # input RMSNorm's backward, last: all grads but its weight's, its fp32 input and about four
    # fp32 temporaries of the norm's backward, the residual grad and dL/dh (and the output)
    sums = 0 if frozen is not None else _tile_sums(spec, prec, N, tile, into)
    return _backward_peak(spec, N, prec, (_tiled(spec, prec, N, tile, per_token, ff, queries)
                                          + sums + mask, H * I * c),
                          (_input_norm(spec, prec, N, tile, queries, H * (20 + 2 * c + out)),
                           P * c), frozen, into, _saved_tokens(N, tile, queries))


def _saved_tokens(N: int, tile: int, queries: str) -> int:
    """Tokens whose adapter activations (a frozen base's LoRA) are alive at once: a tile's in
    tiles of queries, else every token's (the feed-forward tiles keep the mixer's whole)."""
    return _ff_tokens(N, tile) if queries else N


def _input_norm(spec: ModelSpec, prec: Precision, N: int, tile: int, queries: str,
                per_token: int) -> int:
    """The input norm's backward (``per_token`` bytes a token): for every token at once, or in
    tiles of queries (models.recompute.query_tiled_grads) a tile's, beside what spans the
    sequence."""
    if not queries or _ff_tokens(N, tile) >= N:
        return N * per_token
    return _ff_tokens(N, tile) * per_token + _query_span(spec, prec, N, queries)


def _query_span(spec: ModelSpec, prec: Precision, N: int, queries: str) -> int:
    """What spans the sequence in tiles of queries: k and v (no graph), their fp32 gradient
    sums, dL/dx, and the last tile's attention grads over every key: dL/dk and dL/dv, and with
    grouped KV heads their copies as wide as the query heads (CUDA's flash backward makes
    them; on the CPU the term matched the allocator at 4:1 and errs high at 8:1)."""
    c, r, H, q, kv = prec.c, prec.r, spec.hidden_size, spec.q_width, spec.kv_width
    wide = 2 * q * c if q > kv else 0
    return N * (2 * kv * c + 2 * kv * 4 + H * r + 2 * kv * c + wide)


def _tile_sums(spec: ModelSpec, prec: Precision, N: int, tile: int, into: bool) -> int:
    """What models.recompute.tiled_grads' fp32 sums of the returned parameter grads (with ``into``
    only the norms' and biases': the projections add into the gradient slot) hold beyond a
    compute-dtype copy of them: (4 - c) bytes a parameter. The compute-dtype copy is within the
    other terms: with compute-dtype sums the model matched the CPU allocator's peaks in fp32
    and in bf16, and the fp32 sums moved the bf16 peak by about 2 bytes a parameter
    (tests/engine/plan/test_plan_memory.py)."""
    if _ff_tokens(N, tile) >= N or prec.c >= 4:
        return 0
    entries = spec.largest_layout.entries
    return (4 - prec.c) * sum(math.prod(s) for n, _, s in entries
                              if not (into and n.endswith("_proj.weight")))


def _tiled(spec: ModelSpec, prec: Precision, N: int, tile: int, per_token: int, ff: int,
           queries: str = "") -> int:
    """Bytes saved at the feed-forward's backward for N tokens of ``per_token`` bytes, of which
    ``ff`` are the feed-forward's own. In tiles (models.recompute.tiled_grads) the larger of two
    moments: a tile's backward (the mixer's part for every token, the tile's feed-forward part,
    the detached mid residual, dL/d(mid residual) and the tile's output), and the attention's
    backward after the tiles, where the mixer's part meets its grads: dL/d(mid residual) and
    dL/dx (residual dtype), dL/dh, dL/d(output), its (B, T, H) copy and dL/dq, dL/dk and dL/dv
    as repeated to the query heads (GQA) and as reduced to the KV heads.

    In tiles of queries (``queries``; models.recompute.query_tiled_grads) a tile holds the whole
    layer's activations and the attention's grads of its queries, beside :func:`_query_span`;
    with a mask (``queries`` "mask": the CPU's causal rows, or a document mask) the tile's rows
    of it over every key, boolean and as the additive float SDPA makes of it (6 bytes each:
    the CPU allocator's peaks, tests/engine/plan/test_plan_memory.py)."""
    t = _ff_tokens(N, tile)
    if t >= N:
        return N * per_token
    c, r, H, q, kv = prec.c, prec.r, spec.hidden_size, spec.q_width, spec.kv_width
    mixer = per_token - ff
    grads = 2 * H * r + H * c + 3 * q * c + 2 * (q if q > kv else kv) * c + 2 * kv * c
    if queries:
        return (_query_span(spec, prec, N, queries) + t * (per_token + 2 * H * r + H * c + 3 * q * c)
                + (t * N * 6 if queries == "mask" else 0))
    tiles = N * (mixer + 2 * H * r) + t * (ff + H * r)
    return max(tiles, N * (mixer + grads))


def _backward_peak(spec: ModelSpec, N: int, prec: Precision, mlp: tuple[int, int],
                   norm1: tuple[int, int], frozen: FrozenBase | None = None,
                   into: bool = False, saved: int | None = None) -> list[Allocation]:
    """The recompute's peak, of (activations, grads) at the MLP's backward, at the input norm's
    backward, at the end of the layer and in the embedding's backward. A ``frozen`` base has
    no weight grads at any of them, only its adapters' (held from the end of autograd.grad
    until they join the adapters' fp32 gradient), the adapters' saved activations beside the
    MLP's, and no embedding backward. ``into``: the projection weights' grads are added to the
    fp32 slot inside their matmuls (runtime.backward.grads_into), so only the norms' and biases' exist
    in the compute dtype."""
    c, H, P = prec.c, spec.hidden_size, spec.params_per_layer
    rest = [math.prod(s) for n, _, s in spec.largest_layout.entries if not n.endswith("_proj.weight")]
    if into:
        mlp, norm1, P = (mlp[0], 0), (norm1[0], sum(rest) * c), sum(rest)
    largest = max(rest) if into else _largest_layer_tensor(spec)
    # adding a narrower grad into the fp32 slot goes through an fp32 copy of that tensor
    end = N * H * prec.r, P * c + (largest * 4 if c < 4 else 0)
    embed_grad = N * H * 4 if prec.r < 4 else 0  # _embed_backward: gy.float() per micro-batch
    if frozen is not None:  # dL/dx beside the output decoder_layer formed
        acts = max(mlp[0] + (N if saved is None else saved) * frozen.saved_per_token,
                   norm1[0], 2 * end[0])
        return [Allocation("gpu", "recompute activations", acts,
                           f"one layer, one micro-batch of {N:,} tokens, with autograd", "backward"),
                Allocation("gpu", "adapter grads", frozen.grads, "one layer's adapter grads as "
                           "autograd returns them, and their fp32 copy", "backward")]
    acts, grads = max(mlp, end, norm1, (embed_grad, 0), key=lambda ag: ag[0] + ag[1])
    return [Allocation("gpu", "recompute activations", acts,
                       f"one layer, one micro-batch of {N:,} tokens, with autograd", "backward"),
            Allocation("gpu", "layer grads in compute dtype", grads,
                       "per-micro-batch parameter grads before they join the fp32 slot", "backward")]


def fused_forward_scratch(spec: ModelSpec, N: int, B: int, T: int, prec: Precision,
                          masked: bool, tile: int = 0) -> Allocation:
    """decoder_layer without autograd, one micro-batch, fused Triton RMSNorm, RoPE and SwiGLU.

    The MLP peaks in the Triton SwiGLU, which writes its product without a silu(g) (the PyTorch
    path's fourth N x I tensor): gate, up and product (N x I each) beside the normed input and
    the mid residual (models.layers.gated frees gate and up before the down projection). The norms write only
    y (and an fp32 rsqrt per row): no fp32 copies. Attention peaks while RoPE rotates k (q and
    k before and after, v, the normed input; with QK-norm the normed q and k in the residual
    dtype) or inside SDPA (its output, fp32 log-sum-exp per head, and the additive copy of a
    boolean mask, which lives only there). FlexAttention needs no such copy.
    """
    c, r, H, I = prec.c, prec.r, spec.hidden_size, spec.ffn_width
    q, kv = spec.q_width, spec.kv_width  # the widest layer's (Gemma 4's full layers)
    t = _ff_tokens(N, tile)  # in tiles: a tile's beside the mid residual and the output
    mlp = t * (3 * I * c + H * c + H * r) + (N * H * r * 2 if t < N else 0)
    rotate = (q + kv) * (r + c) + kv * c if spec.qk_norm else 2 * q * c + 3 * kv * c
    attn = N * (H * c + rotate + 4 * spec.num_heads) + (B * T * T * c if masked else 0)
    return Allocation("gpu", "layer forward scratch", max(mlp, attn),
                      f"one micro-batch of {N:,} tokens, one layer, no autograd (fused kernels)",
                      "forward")


def fused_recompute_scratch(spec: ModelSpec, N: int, B: int, T: int, prec: Precision,
                            masked: bool, frozen: FrozenBase | None = None,
                            into: bool = False, tile: int = 0,
                            queries: str = "") -> list[Allocation]:
    """_layer_backward for one micro-batch on the fused Triton RMSNorm, RoPE and SwiGLU.

    Saved per token at the MLP's backward (the peak for long micro-batches): the two normed
    inputs (compute dtype; each Triton RMSNorm keeps its input, the checkpoint or the mid
    residual, which the layer holds anyway, and an fp32 rsqrt per row), the mid residual
    (residual dtype; layer_backward never forms the output, a ``frozen`` base's recompute
    through decoder_layer does); rotated q, the attention output, rotated k and v (the Triton RoPE
    keeps only the tables), fp32 log-sum-exp per head; gate and up (the Triton SwiGLU recomputes
    silu(g) in its backward), and dL/d(product), dL/dgate, dL/dup: 5 per I where the PyTorch
    ops hold 6. The down projection's weight grad is alive. QK-norm: each norm keeps a
    contiguous copy of q or k and an fp32 rsqrt per head and row, and its contiguous output
    makes the attention output's (B, T, heads x head_dim) view a copy, kept by o_proj. The
    additive copy of a boolean document mask is saved by SDPA; FlexAttention's BlockMask is
    counted with the step (attention_masks). At the input norm's backward: the residual grad,
    the norm's dL/dx and their sum (residual dtype) and dL/dh (and a frozen base's output).
    """
    c, r, H, I = prec.c, prec.r, spec.hidden_size, spec.ffn_width
    nh, nkv = spec.num_heads, spec.num_kv_heads
    q, kv = spec.q_width, spec.kv_width
    qk = (2 * q + kv) * c + 4 * (nh + nkv) if spec.qk_norm else 0
    out = 0 if frozen is None else r  # per H element: the frozen recompute's output
    per_token = H * (2 * c + r + out) + 2 * q * c + 2 * kv * c + 5 * I * c + qk + 4 * nh + 8
    mask = B * T * T * c if masked else 0
    ff = H * c + 5 * I * c + 4  # the feed-forward's normed input and rsqrt, its MLP's
    sums = 0 if frozen is not None else _tile_sums(spec, prec, N, tile, into)
    return _backward_peak(spec, N, prec, (_tiled(spec, prec, N, tile, per_token, ff, queries)
                                          + sums + mask, H * I * c),
                          (_input_norm(spec, prec, N, tile, queries, H * (3 * r + c + out)),
                           spec.params_per_layer * c), frozen, into,
                          _saved_tokens(N, tile, queries))


def _largest_layer_tensor(spec: ModelSpec) -> int:
    return max(math.prod(s) for lay in set(spec.layouts) for _, _, s in lay.entries)
