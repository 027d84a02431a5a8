"""Fused CPU AdamW on a bf16 + remainder master: one pass over memory.

For each element, in one loop (OpenMP threads, compiler-vectorised):

    u      = (w << 16 | rem)               the stored halves of bits(master) + 0x8000
    p      = float(u - 0x8000)             exact fp32 master
    g'     = g * grad_scale                (global-norm clipping coefficient)
    m      = b1 m + (1 - b1) g'
    v      = b2 v + (1 - b2) g'^2
    p      = p (1 - lr wd) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)      (torch.optim.AdamW)
    w, rem = halves of bits(p) + 0x8000    (w: p rounded to nearest bf16)

It reads 16 and writes 12 bytes per parameter, the same traffic as ``torch.optim.AdamW(fused=
True)`` over fp32 parameters. The C source is compiled once per machine with the system C
compiler into the user cache (a fraction of a second); without a compiler the update falls back
to the chain of PyTorch ops in ``engine.runtime.host_state.adam_update`` (the reference: several
passes through a cache-sized scratch, slower, same results to rounding).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* omb1 = 1 - b1 and omb2 = 1 - b2 come from the caller in double precision: 1 - 0.999f in
   float is off by 1.3e-5 relative. */
void adamw_bf16_rem(uint16_t *w, uint16_t *rem, const float *g, float *m, float *v, int64_t n,
                    float lr, float b1, float b2, float omb1, float omb2, float eps, float wd,
                    float bc1, float bc2, float gscale, int threads) {
    const float step = lr / bc1, bc2s = sqrtf(bc2), decay = 1.0f - lr * wd;
    #pragma omp parallel for simd schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (((uint32_t)w[i]) << 16) | (uint32_t)rem[i];
        uint32_t bits = u - 0x8000u;
        float p;
        memcpy(&p, &bits, 4);
        float gi = g[i] * gscale;
        float mi = b1 * m[i] + omb1 * gi;
        float vi = b2 * v[i] + omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p = p * decay - step * mi / (sqrtf(vi) / bc2s + eps);
        memcpy(&bits, &p, 4);
        u = bits + 0x8000u;
        w[i] = (uint16_t)(u >> 16);
        rem[i] = (uint16_t)(u & 0xFFFFu);
    }
}
"""

_lib = None
_tried = False
BUILD_ERROR = ""
"""The compiler's message when the kernel could not be built (the fallback is then in use)."""


def _cache_dir() -> Path:
    try:
        from platformdirs import user_cache_dir
        return Path(user_cache_dir("slideformer")) / "kernels"
    except ImportError:  # the kernel still builds without platformdirs
        return Path(tempfile.gettempdir()) / "slideformer-kernels"


def _build(parallel: str) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    # -fno-math-errno lets the compiler vectorise sqrtf (with errno it is a library call per
    # element and the loop stays scalar); it changes no result. "threads" builds the loop
    # without an OpenMP runtime (simd pragma only) and splits the work over Python threads
    # (ctypes releases the GIL), so it never competes with PyTorch's own OpenMP threads.
    omp = "-fopenmp" if parallel == "openmp" else "-fopenmp-simd"
    flags = ["-O3", "-march=native", "-fno-math-errno", omp, "-fPIC", "-shared"]
    tag = hashlib.sha256((_SOURCE + cc + " ".join(flags)).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_adam_{tag}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".c")
        src.write_text(_SOURCE)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, *flags, str(src), "-o", str(tmp), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            global BUILD_ERROR
            BUILD_ERROR = done.stderr.strip()[-2000:]
            return None
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    f = lib.adamw_bf16_rem
    f.restype = None
    f.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 10 + [ctypes.c_int]
    return lib


def native_available() -> bool:
    """Whether the compiled kernel is in use (compiling it on first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("SLIDEFORMER_NO_NATIVE_ADAM") != "1":
            _lib = _build(PARALLEL)
    return _lib is not None


def fused_update(w, rem, g, m, v, lr, b1, b2, eps, wd, step, gscale) -> None:
    """AdamW step on contiguous 1-D views: w bf16, rem int16, g/m/v fp32 (in place)."""
    args = (lr, b1, b2, 1 - b1, 1 - b2, eps, wd, 1 - b1 ** step, 1 - b2 ** step, gscale)

    def part(s: int, e: int) -> None:
        _lib.adamw_bf16_rem(w[s:].data_ptr(), rem[s:].data_ptr(), g[s:].data_ptr(),
                            m[s:].data_ptr(), v[s:].data_ptr(), e - s, *args, THREADS)

    n = w.numel()
    if PARALLEL == "openmp" or n < (1 << 16):
        part(0, n)
        return
    step_n = ((n + THREADS - 1) // THREADS + 63) // 64 * 64  # 64-element aligned parts
    list(_pool().map(lambda s: part(s, min(s + step_n, n)), range(0, n, step_n)))


_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _POOL = ThreadPoolExecutor(THREADS, "cpu-adam-part")
    return _POOL


# One core is left to the thread that drives the GPU: when the update saturates every core,
# kernel launches queue behind it and the GPU starves.
THREADS = max(1, torch.get_num_threads() - 1)
PARALLEL = os.environ.get("SLIDEFORMER_CPU_ADAM_PARALLEL", "threads")
