"""What every contender process of the side-by-side benchmark shares (benchmarks/contenders.py
runs one): the configuration it gets, the ``MARK`` records it prints, the figures of a result row,
the guard that turns one failed size into an error record, and the Hugging Face helpers of the
dense, deepspeed and slideformer contenders."""
from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from sliding_step import SHAPES, peak_rss, random_batches, shape_spec

MARK = "@@SBS "
CONTENDERS = ("dense", "resident", "deepspeed", "slideformer", "sliding")
CAPPED = ("deepspeed", "slideformer", "sliding")
"""Contenders run under the VRAM cap; the others are uncapped."""
GiB = 1 << 30
LR = 1e-5
"""AdamW learning rate of every contender (weight decay 0, betas 0.9/0.999, eps 1e-8), as
sliding_step.py's engine runs use."""


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

