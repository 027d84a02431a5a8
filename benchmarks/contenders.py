"""The contenders of the side-by-side benchmark, each run in a process of its own.

    python3 benchmarks/contenders.py CONTENDER '<BenchConfig as JSON>'

benchmarks/side_by_side.py starts one such process per contender (fresh CUDA context, clean
peaks), samples its process tree's RSS and reads the lines it prints that start with ``MARK``:
one JSON record each, ``kind`` one of

    info       facts about the process (versions, GPU, parameters, set-up time)
    result     one grad-accum size: step times, tokens/s, TFLOP/s, peak VRAM, VmHWM, bottleneck
    max_batch  one try of the largest-micro-batch search at grad_accum 1
    error      one size that failed (out of memory, ...); the process goes on with the next
    skipped    the contender cannot run here (no GPU, no DeepSpeed)

Everything else on stdout/stderr (DeepSpeed's logging) is noise to the reader.

Contenders, all on the same random-init Llama shape and the same seeded token ids:
    dense      HF LlamaForCausalLM, all in VRAM: fp32 master weights, bf16 autocast, gradient
               checkpointing, SDPA, torch AdamW(fused) on the GPU; uncapped
    resident   our engine as the planner shapes it for the whole GPU: every layer, its master
               weights and moments in VRAM and updated there (dense training in our engine);
               uncapped (on the CPU backend: K = L slots)
    deepspeed  DeepSpeed ZeRO-3, parameters and optimizer offloaded to CPU (DeepSpeedCPUAdam),
               bf16, HF model with gradient checkpointing built under zero.Init; VRAM capped
    slideformer  SlideFormer's public code (github.com/RegiaYoung/SlideFormer, Apache-2.0; a
               checkout in the git-ignored .contenders/SlideFormer, never part of the package):
               its offloader over a random-init HF Llama with Liger's fused kernels, SDPA, CPU
               LayerAdam overlapped with the backward, no clipping; no gradient accumulation,
               so each grad-accum size runs as one micro-batch of micro_batch * grad_accum
               sequences (the same tokens/step); VRAM capped
    sliding    our engine as the planner shapes it for the cap (slots, checkpoint placement,
               device optimizer for spare VRAM), or K = --slots with every update on the CPU;
               VRAM capped

Every contender trains on micro_batch * (seq - 1) labelled tokens per micro-batch (HF shifts
``labels = input_ids`` inside its loss; ours gets the shifted labels with the last position
unlabelled, sliding_step.random_batches). Tokens/step and TFLOP/s count all micro_batch * seq
positions, as compute does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from sliding_step import (SHAPES, make_backend, peak_rss, plan_shape, random_batches, random_state,
                          run_config, shape_spec)

MARK = "@@SBS "
CONTENDERS = ("dense", "resident", "deepspeed", "slideformer", "sliding")
CAPPED = ("deepspeed", "slideformer", "sliding")
"""Contenders run under the VRAM cap; the others are uncapped."""
GiB = 1 << 30
LR = 1e-5
"""AdamW learning rate of every contender (weight decay 0, betas 0.9/0.999, eps 1e-8), as
sliding_step.py's engine runs use."""
OUR_LANES = {"compute": "GPU compute", "h2d": "PCIe H2D", "d2h": "PCIe D2H",
             "optimizer": "CPU optimizer"}


@dataclass(frozen=True)
class BenchConfig:
    """What every contender process of one comparison runs."""
    shape: str
    """A key of sliding_step.SHAPES."""
    seq: int
    micro_batch: int
    grad_accum: tuple[int, ...]
    """One measurement per value, all in one process (model built once)."""
    vram_cap: float
    """GiB for the capped contenders (CAPPED); 0: none."""
    slots: int = 0
    """K of the sliding contender."""
    clip: float = 1.0
    """Global-norm gradient clipping; 0: off."""
    warmup: int = 2
    steps: int = 5
    head_chunk: int = 2048
    """Tokens per LM-head chunk of our engine (sliding_step.py's default)."""
    device: str = "cuda"
    """cuda, or cpu for a dry run of the harness (caps are then not applied)."""
    dense_dtype: str = "fp32-master"
    """fp32-master (bf16 autocast over fp32 weights and AdamW) or bf16 (weights and AdamW)."""
    max_batch: bool = False
    """Also search the largest micro-batch at grad_accum 1 (deepspeed and sliding)."""
    ds_batches: tuple[int, ...] = (10, 12, 14, 16)
    """Micro-batches DeepSpeed tries in turn, up to the first out-of-memory."""

    def __post_init__(self):
        object.__setattr__(self, "grad_accum", tuple(self.grad_accum))
        object.__setattr__(self, "ds_batches", tuple(self.ds_batches))

    @staticmethod
    def from_json(text: str) -> "BenchConfig":
        return BenchConfig(**json.loads(text))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


# ---- records ------------------------------------------------------------------------------------
def emit(kind: str, **fields) -> None:
    print(MARK + json.dumps(dict(kind=kind, **fields), default=str), flush=True)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / GiB, 2)


def vram_peaks(cfg: BenchConfig) -> dict:
    if cfg.device != "cuda":
        return dict(peak_vram_alloc_gib=None, peak_vram_reserved_gib=None)
    return dict(peak_vram_alloc_gib=_gib(torch.cuda.max_memory_allocated()),
                peak_vram_reserved_gib=_gib(torch.cuda.max_memory_reserved()))


def reset_vram_peaks(cfg: BenchConfig) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def cap_vram(cfg: BenchConfig) -> None:
    """Emulate a smaller card: the caching allocator may reserve at most ``vram_cap`` GiB (the
    CUDA context is outside the cap)."""
    if cfg.device == "cuda" and cfg.vram_cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cfg.vram_cap * GiB / total)


def environment(cfg: BenchConfig) -> dict:
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=hf,
               host=platform.node(), cpu_threads=torch.get_num_threads())
    if cfg.device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0),
                   gpu_total_gib=_gib(torch.cuda.get_device_properties(0).total_memory))
    return env


def summary(cfg: BenchConfig, micro_batch: int, accum: int, times: list[float],
            losses: list[float], bounding: str, **extra) -> dict:
    """The figures every result row has (median over the timed steps)."""
    spec = shape_spec(cfg.shape)
    tokens = micro_batch * cfg.seq * accum
    med = statistics.median(times[cfg.warmup:])
    return dict(micro_batch=micro_batch, grad_accum=accum, seq=cfg.seq, tokens_per_step=tokens,
                step_time_s=round(med, 4), step_times_s=[round(t, 4) for t in times],
                tokens_per_s=round(tokens / med, 1),
                model_tflops=round(6 * spec.num_params * tokens / med / 1e12, 1),
                **vram_peaks(cfg), peak_rss_gib=_gib(peak_rss()), bounding=bounding,
                losses=[round(x, 4) for x in losses], **extra)


# ---- Hugging Face contenders (dense, deepspeed) ------------------------------------------------
def hf_config(shape: str):
    from transformers import LlamaConfig
    return LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=131072, use_cache=False)


def hf_params(model) -> int:
    """Parameters of an HF model (tied ones once; ZeRO-3 partitioned ones at full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def token_ids(cfg: BenchConfig, micro_batch: int, accum: int) -> list[torch.Tensor]:
    """The same ids our engine trains on (sliding_step.random_batches), on the device."""
    vocab = SHAPES[cfg.shape]["vocab_size"]
    return [mb.input_ids.to(cfg.device) for mb in random_batches(vocab, micro_batch, cfg.seq, accum)]


def time_hf_steps(cfg: BenchConfig, step, ids: list[torch.Tensor]) -> tuple[list, list, dict]:
    """Run warm-up + timed steps of ``step(ids, sync) -> (loss, fwd_bwd_s, optimizer_s)``; the
    GPU is synchronised at both ends of each step. Returns times, losses, median phase times."""
    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
    times, losses, fb, opt = [], [], [], []
    for _ in range(cfg.warmup + cfg.steps):
        sync()
        t0 = time.perf_counter()
        loss, fwd_bwd, optimizer = step(ids, sync)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        fb.append(fwd_bwd)
        opt.append(optimizer)
    phases = dict(fwd_bwd_s=round(statistics.median(fb[cfg.warmup:]), 4),
                  optimizer_s=round(statistics.median(opt[cfg.warmup:]), 4))
    return times, losses, phases


def hf_bounding(phases: dict, fwd_bwd: str, optimizer: str) -> str:
    """The larger of the two measured phases of an HF step, named after what it exercises."""
    fb, op = phases["fwd_bwd_s"], phases["optimizer_s"]
    name, t = (fwd_bwd, fb) if fb >= op else (optimizer, op)
    return f"{name} ({t:.2f} of {fb + op:.2f} s)"


def run_dense(cfg: BenchConfig) -> None:
    from transformers import AutoModelForCausalLM
    bf16 = cfg.dense_dtype == "bf16"
    t0 = time.perf_counter()
    with torch.device(cfg.device):
        model = AutoModelForCausalLM.from_config(
            hf_config(cfg.shape), dtype=torch.bfloat16 if bf16 else torch.float32,
            attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, fused=True)
    autocast = (contextlib.nullcontext if bf16 else
                lambda: torch.autocast(cfg.device, dtype=torch.bfloat16))
    emit("info", **environment(cfg), params=hf_params(model), dtype=cfg.dense_dtype,
         setup_s=round(time.perf_counter() - t0, 1))

    def step(ids, sync):
        t0 = time.perf_counter()
        total = torch.zeros((), device=cfg.device)
        for x in ids:
            with autocast():
                loss = model(input_ids=x, labels=x).loss
            (loss / len(ids)).backward()  # equal labelled tokens per micro-batch: the step's mean
            total += loss.detach()
        sync()
        t1 = time.perf_counter()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return float(total) / len(ids), t1 - t0, time.perf_counter() - t1

    for accum in cfg.grad_accum:
        def measure():
            reset_vram_peaks(cfg)
            times, losses, phases = time_hf_steps(cfg, step, token_ids(cfg, cfg.micro_batch, accum))
            where = "GPU compute" if cfg.device == "cuda" else "CPU compute"
            return summary(cfg, cfg.micro_batch, accum, times, losses,
                           hf_bounding(phases, f"{where} (fwd+bwd)", "optimizer step"), **phases)
        guarded("result", cfg, accum, measure)


def ds_config(cfg: BenchConfig, accum: int) -> dict:
    """ZeRO-3 with parameters and optimizer state on the CPU (DeepSpeed's defaults otherwise)."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": accum,
        "train_batch_size": cfg.micro_batch * accum,
        "gradient_clipping": cfg.clip,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(cfg: BenchConfig):
    """The engine on an HF model built under zero.Init (HF's own ZeRO-3 path: HfDeepSpeedConfig
    alive while ``from_config`` runs), so the full model never sits in VRAM."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    ds_cfg = ds_config(cfg, cfg.grad_accum[0])
    deepspeed.init_distributed(dist_backend="nccl" if cfg.device == "cuda" else "gloo")
    keep = HfDeepSpeedConfig(ds_cfg)  # HF finds it through a weak reference: keep it alive
    model = AutoModelForCausalLM.from_config(hf_config(cfg.shape), dtype=torch.bfloat16,
                                             attn_implementation="sdpa")
    if not hasattr(next(model.parameters()), "ds_id"):
        raise RuntimeError("transformers did not build the model under deepspeed.zero.Init "
                           "(is accelerate importable?): the ZeRO-3 comparison would be wrong")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_cfg)
    return engine, ds_cfg, keep


def deepspeed_step(engine, device: str):
    """One optimizer step over the given micro-batches. The accumulation boundary is set per
    micro-batch (engine.set_gradient_accumulation_boundary), so one engine serves every
    grad-accum size: set_train_batch_size sets the 1/accum loss scale, the explicit boundary
    replaces DeepSpeed's micro-step counter (which would be misaligned after a size change)."""
    def step(ids, sync):
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i, x in enumerate(ids):
            engine.set_gradient_accumulation_boundary(i == len(ids) - 1)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            total += loss.detach()
        sync()
        t1 = time.perf_counter()
        engine.step()
        sync()
        return float(total) / len(ids), t1 - t0, time.perf_counter() - t1
    return step


def run_deepspeed(cfg: BenchConfig) -> None:
    if cfg.device == "cpu":  # dry run: DeepSpeed's CPU accelerator (gloo, no pinned memory)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        emit("skipped", reason=f"deepspeed is not importable ({e}); benchmarks/run_side_by_side.sh "
                               "installs it from .whl")
        return
    cap_vram(cfg)
    t0 = time.perf_counter()
    engine, ds_cfg, _keep = build_deepspeed(cfg)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    emit("info", **environment(cfg), deepspeed=deepspeed.__version__, params=hf_params(engine.module),
         optimizer=type(optimizer).__name__, ds_config=ds_cfg,
         setup_s=round(time.perf_counter() - t0, 1))
    step = deepspeed_step(engine, cfg.device)

    def measure(mb: int, accum: int) -> dict:
        engine.set_train_micro_batch_size(mb)
        engine.set_train_batch_size(mb * accum)
        reset_vram_peaks(cfg)
        before = engine.global_steps
        times, losses, phases = time_hf_steps(cfg, step, token_ids(cfg, mb, accum))
        return summary(cfg, mb, accum, times, losses,
                       hf_bounding(phases, "GPU compute + parameter fetch (fwd+bwd)",
                                   "CPU Adam + PCIe (step)"), **phases,
                       optimizer_steps=engine.global_steps - before)  # must be warmup + steps

    for accum in cfg.grad_accum:
        guarded("result", cfg, accum, lambda: measure(cfg.micro_batch, accum))
    if cfg.max_batch:
        for mb in cfg.ds_batches:
            if not guarded("max_batch", cfg, 1, lambda: measure(mb, 1), micro_batch=mb):
                break


# ---- SlideFormer's public code ------------------------------------------------------------------
SLIDEFORMER_DIR = Path(__file__).resolve().parents[1] / ".contenders" / "SlideFormer"
"""A checkout of github.com/RegiaYoung/SlideFormer (Apache-2.0), kept out of the repository
(git-ignored); benchmarks/run_side_by_side.sh says how to get it there."""


def _slideformer_importable() -> str | None:
    """Why SlideFormer cannot run here, or None."""
    if not (SLIDEFORMER_DIR / "offload_transformer.py").is_file():
        return (f"no SlideFormer checkout at {SLIDEFORMER_DIR.name}/ under .contenders/ "
                "(git clone https://github.com/RegiaYoung/SlideFormer .contenders/SlideFormer)")
    try:
        import liger_kernel  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not importable ({e}); run_side_by_side.sh installs it from .whl"
    return None


def _allow_cache_position() -> None:
    """SlideFormer's mask helper passes ``cache_position=`` to transformers' create_causal_mask,
    which transformers 5 no longer takes; the mask does not depend on it without a KV cache."""
    from transformers import masking_utils
    original = masking_utils.create_causal_mask

    def create_causal_mask(*args, cache_position=None, **kwargs):
        return original(*args, **kwargs)
    masking_utils.create_causal_mask = create_causal_mask


def build_slideformer(cfg: BenchConfig):
    """SlideFormer's offloader over a random-init HF Llama with Liger's kernels (its benchmark's
    defaults: bf16, LayerAdam on the CPU with fp32 states, no NVMe), attention through SDPA
    (flash-attn is not installed on the reference machine)."""
    sys.path.insert(0, str(SLIDEFORMER_DIR))
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from offload_transformer import SlideFormerOffloader
    from transformers import AutoModelForCausalLM
    _allow_cache_position()
    apply_liger_kernel_to_llama()  # what AutoLigerKernelForCausalLM does for a Llama checkpoint
    model = AutoModelForCausalLM.from_config(hf_config(cfg.shape), dtype=torch.bfloat16,
                                             attn_implementation="sdpa")
    layers = len(model.get_decoder().layers)
    offload_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "slideformer_offload"
    optimizer = dict(lr=LR, bias_correction=True, weight_decay=0.0, eps=1e-8,
                     fp32_optimizer_state=True, num_layer=layers + 2, nvme_offload_fraction=0.0,
                     offload_dir=str(offload_dir), prefetch=True)
    return SlideFormerOffloader(model=model, device=torch.device("cuda:0"), dtype=torch.bfloat16,
                                ac_offload_nvme=False, offload_dir=str(offload_dir),
                                enable_timing=False, enable_memory_stats=False,
                                optimizer_kwargs=optimizer), model


def run_slideformer(cfg: BenchConfig) -> None:
    why = _slideformer_importable() if cfg.device == "cuda" else "SlideFormer needs CUDA"
    if why:
        emit("skipped", reason=why)
        return
    cap_vram(cfg)
    t0 = time.perf_counter()
    offloader, model = build_slideformer(cfg)
    offloader.train()
    emit("info", **environment(cfg), params=hf_params(model), source=str(SLIDEFORMER_DIR.name),
         setup_s=round(time.perf_counter() - t0, 1))
    for accum in cfg.grad_accum:
        # no gradient accumulation in SlideFormer: the same tokens/step as one micro-batch
        mb = cfg.micro_batch * accum
        guarded("result", cfg, accum, lambda: slideformer_row(cfg, offloader, mb, accum))


def slideformer_row(cfg: BenchConfig, offloader, mb: int, accum: int) -> dict:
    """Warm-up + timed steps of ``mb`` sequences; one step is one call of the offloader (its
    forward runs the loss, the backward and waits for every layer's CPU update, as its own
    benchmark script times it), then the GPU is synchronised."""
    (ids,) = token_ids(cfg, mb, 1)
    ones = torch.ones_like(ids)
    reset_vram_peaks(cfg)
    times, losses = [], []
    for _ in range(cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        out = offloader(input_ids=ids, attention_mask=ones, labels=ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(out.loss))
    row = summary(cfg, mb, 1, times, losses, f"not measured; ran as one micro-batch of {mb} "
                                             "(no gradient accumulation)")
    return dict(row, grad_accum=accum)  # the table's row for this many tokens/step


# ---- our engine (resident, sliding) ------------------------------------------------------------
def our_args(cfg: BenchConfig, micro_batch: int, slots: int, checkpoints: str = "gpu",
             head_chunk: int | None = None, warmup: int | None = None, steps: int | None = None):
    """sliding_step.run_config's arguments."""
    return SimpleNamespace(shape=cfg.shape, micro_batch=micro_batch, seq=cfg.seq, slots=slots,
                           checkpoints=checkpoints, head_chunk=head_chunk or cfg.head_chunk,
                           clip=cfg.clip, vram_cap=cfg.vram_cap,
                           warmup=cfg.warmup if warmup is None else warmup,
                           steps=cfg.steps if steps is None else steps, precision="bf16")


def our_row(cfg: BenchConfig, res: dict) -> dict:
    """run_config's figures plus the bounding resource: the busiest lane of a late step
    (run_config reads the timeline of the last step but one)."""
    busy = res["busy_last_step_s"]
    lane = max(busy, key=busy.get)
    name = "CPU compute" if lane == "compute" and cfg.device == "cpu" else OUR_LANES[lane]
    return dict(res, bounding=f"{name} (busy {busy[lane]:.2f} s of a step; median step "
                              f"{res['step_time_s']:.2f} s)")


def run_ours(cfg: BenchConfig, contender: str) -> None:
    backend = make_backend(cfg.device)
    if contender in CAPPED:
        cap_vram(cfg)
    t0 = time.perf_counter()
    spec = shape_spec(cfg.shape)
    host = random_state(spec, backend, torch.float32, layer_grads=cfg.clip > 0)
    emit("info", **environment(cfg), params=spec.num_params,
         setup_s=round(time.perf_counter() - t0, 1))
    for accum in cfg.grad_accum:
        guarded("result", cfg, accum, lambda: our_planned(cfg, spec, host, backend, contender, accum))
    if cfg.max_batch and contender == "sliding":
        our_max_batch(cfg, spec, host, backend)
    backend.release_host()


def our_planned(cfg: BenchConfig, spec, host, backend, contender: str, accum: int) -> dict:
    """One size with the executor shape ``slideformer train`` would run: the planner's, for the
    cap (sliding) or the whole GPU (resident: every layer, its master weights and moments on the
    GPU, i.e. dense training inside our engine). ``--slots`` > 0 fixes K for sliding instead,
    with checkpoints on the GPU and every update on the CPU."""
    vram = cfg.vram_cap if contender in CAPPED else 0
    if cfg.device != "cuda" or (contender == "sliding" and cfg.slots):
        slots = spec.num_layers if contender == "resident" else (cfg.slots or 2)
        return our_row(cfg, run_config(spec, host, backend, our_args(cfg, cfg.micro_batch, slots), accum))
    plan = plan_shape(spec, cfg.micro_batch, cfg.seq, accum, cfg.clip, vram)
    shape = plan.exec_shape
    row = run_config(spec, host, backend, our_args(cfg, cfg.micro_batch, shape.slots), accum, shape)
    return our_row(cfg, dict(row, planner_verdict=plan.verdict,
                             predicted_tokens_per_s=round(plan.speed.tokens_per_s),
                             predicted_vram_gib=round(plan.tier("gpu").peak / GiB, 2)))


def planner_shape(cfg: BenchConfig, spec, micro_batch: int):
    """The planner's largest micro-batch at grad_accum 1 under the VRAM cap, and the executor
    shape it picks for ``micro_batch`` (slots and checkpoint placement are its choice)."""
    plan = plan_shape(spec, micro_batch, cfg.seq, 1, cfg.clip, cfg.vram_cap, cfg.device)
    return plan.max_micro_batch, plan.exec_shape, plan.verdict


def our_max_batch(cfg: BenchConfig, spec, host, backend) -> None:
    """Run at the planner's largest micro-batch (expected to fit) and 25% above it (expected
    to run out of memory), each with the planner's shape for that micro-batch."""
    m_max, _, _ = planner_shape(cfg, spec, cfg.micro_batch)
    if not m_max:
        emit("max_batch", micro_batch=0, grad_accum=1, planner_max=0,
             error="the planner finds no micro-batch that fits the cap")
        return
    for mb, expect, warmup, steps in ((m_max, "fits", cfg.warmup, cfg.steps),
                                      (max(m_max + 1, math.ceil(1.25 * m_max)), "oom", 1, 1)):
        _, shape, verdict = planner_shape(cfg, spec, mb)
        args = our_args(cfg, mb, shape.slots, shape.checkpoints, shape.head_chunk, warmup, steps)
        ran = guarded("max_batch", cfg, 1,
                      lambda: our_row(cfg, run_config(spec, host, backend, args, 1, shape)), micro_batch=mb, planner_max=m_max, planner_verdict=verdict, expected=expect,
                      planner_shape=dataclasses.asdict(shape))
        if not ran:  # the planner's own size failed: 25% more tells nothing new
            break


# ---- driver --------------------------------------------------------------------------------------
def guarded(kind: str, cfg: BenchConfig, accum: int, measure, **extra) -> bool:
    """Emit ``measure()``'s row as ``kind``, or an error record; True when it ran."""
    try:
        row = measure()
    except Exception as e:  # noqa: BLE001 - one failed size must not end the contender
        oom = is_oom(e)
        failure = dict(grad_accum=accum, oom=oom, error=f"{type(e).__name__}: {str(e)[:400]}",
                       trace=None if oom else traceback.format_exc()[-2000:], **vram_peaks(cfg))
    else:
        emit(kind, **dict(row, **extra))
        return True
    _release(cfg)  # outside the except block: its traceback no longer holds the step's tensors
    emit("error" if kind == "result" else kind, **failure, **extra)
    return False


def _release(cfg: BenchConfig) -> None:
    import gc
    gc.collect()
    if cfg.device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    contender, cfg = sys.argv[1], BenchConfig.from_json(sys.argv[2])
    if contender not in CONTENDERS:
        raise SystemExit(f"contenders.py: unknown contender {contender!r}; use one of {CONTENDERS}")
    if contender == "dense":
        run_dense(cfg)
    elif contender == "deepspeed":
        run_deepspeed(cfg)
    elif contender == "slideformer":
        run_slideformer(cfg)
    else:
        run_ours(cfg, contender)
    emit("done")


if __name__ == "__main__":
    main()
