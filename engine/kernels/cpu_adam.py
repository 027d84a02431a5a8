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
True)`` over fp32 parameters. With bf16 moments (``optim.moments_dtype = "bfloat16"``) a second
entry point reads m and v as bf16, updates them in fp32 and stores them rounded to nearest even,
as PyTorch's bf16 cast does (8 bytes fewer each way). The C source is compiled once per machine with the system C
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

/* One element: u holds the halves (w << 16 | rem) of bits(master) + 0x8000; returns the new u.
   omb1 = 1 - b1 and omb2 = 1 - b2 come from the caller in double precision: 1 - 0.999f in
   float is off by 1.3e-5 relative. */
static inline uint32_t adam1(uint32_t u, float g, float *m, float *v, float b1, float b2,
                             float omb1, float omb2, float step, float bc2s, float eps,
                             float decay) {
    uint32_t bits = u - 0x8000u;
    float p;
    memcpy(&p, &bits, 4);
    float mi = b1 * *m + omb1 * g;
    float vi = b2 * *v + omb2 * g * g;
    *m = mi;
    *v = vi;
    p = p * decay - step * mi / (sqrtf(vi) / bc2s + eps);
    memcpy(&bits, &p, 4);
    return bits + 0x8000u;
}

/* fp32 <-> bf16 as PyTorch converts: the high half, rounded to nearest even; NaN -> 0x7FC0. */
static inline float from_bf16(uint32_t hi) {
    float f;
    memcpy(&f, &hi, 4);
    return f;
}

static inline uint32_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0u;
    return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

/* Elements are processed in pairs through 32-bit words of w and rem (little-endian: element
   2k in the low half), so every load and store is full width; narrowing 16-bit stores made the
   loop twice as slow on the reference Xeon. An unaligned first or odd last element goes alone. */
void adamw_bf16_rem(uint16_t *w, uint16_t *rem, const float *g, float *m, float *v, int64_t n,
                    float lr, float b1, float b2, float omb1, float omb2, float eps, float wd,
                    float bc1, float bc2, float gscale, int threads) {
    const float step = lr / bc1, bc2s = sqrtf(bc2), decay = 1.0f - lr * wd;
    int64_t s = 0;
    if (n > 0 && ((uintptr_t)w & 3u)) {
        uint32_t u = adam1(((uint32_t)w[0] << 16) | rem[0], g[0] * gscale, m, v, b1, b2, omb1,
                           omb2, step, bc2s, eps, decay);
        w[0] = (uint16_t)(u >> 16);
        rem[0] = (uint16_t)u;
        s = 1;
    }
    const int64_t pairs = (n - s) / 2;
    uint32_t *W = (uint32_t *)(w + s), *R = (uint32_t *)(rem + s);
    const float *G = g + s;
    float *M = m + s, *V = v + s;
    #pragma omp parallel for simd schedule(static) num_threads(threads)
    for (int64_t k = 0; k < pairs; k++) {
        uint32_t w2 = W[k], r2 = R[k];
        uint32_t ue = adam1((w2 << 16) | (r2 & 0xFFFFu), G[2 * k] * gscale, &M[2 * k], &V[2 * k],
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);
        uint32_t uo = adam1((w2 & 0xFFFF0000u) | (r2 >> 16), G[2 * k + 1] * gscale, &M[2 * k + 1],
                            &V[2 * k + 1], b1, b2, omb1, omb2, step, bc2s, eps, decay);
        W[k] = (ue >> 16) | (uo & 0xFFFF0000u);
        R[k] = (ue & 0xFFFFu) | (uo << 16);
    }
    if ((n - s) & 1) {
        int64_t i = n - 1;
        uint32_t u = adam1(((uint32_t)w[i] << 16) | rem[i], g[i] * gscale, &m[i], &v[i], b1, b2,
                           omb1, omb2, step, bc2s, eps, decay);
        w[i] = (uint16_t)(u >> 16);
        rem[i] = (uint16_t)u;
    }
}

/* The same update with bf16 moments: m and v are 16-bit arrays read and written in pairs too. */
static inline uint32_t adam1h(uint32_t u, float g, uint16_t *m, uint16_t *v, float b1, float b2,
                              float omb1, float omb2, float step, float bc2s, float eps,
                              float decay) {
    float mi = from_bf16((uint32_t)*m << 16), vi = from_bf16((uint32_t)*v << 16);
    u = adam1(u, g, &mi, &vi, b1, b2, omb1, omb2, step, bc2s, eps, decay);
    *m = (uint16_t)to_bf16(mi);
    *v = (uint16_t)to_bf16(vi);
    return u;
}

void adamw_bf16_rem_bf16m(uint16_t *w, uint16_t *rem, const float *g, uint16_t *m, uint16_t *v,
                          int64_t n, float lr, float b1, float b2, float omb1, float omb2,
                          float eps, float wd, float bc1, float bc2, float gscale, int threads) {
    const float step = lr / bc1, bc2s = sqrtf(bc2), decay = 1.0f - lr * wd;
    int64_t s = 0;
    if (n > 0 && ((uintptr_t)w & 3u)) {
        uint32_t u = adam1h(((uint32_t)w[0] << 16) | rem[0], g[0] * gscale, m, v, b1, b2, omb1,
                            omb2, step, bc2s, eps, decay);
        w[0] = (uint16_t)(u >> 16);
        rem[0] = (uint16_t)u;
        s = 1;
    }
    const int64_t pairs = (n - s) / 2;
    uint32_t *W = (uint32_t *)(w + s), *R = (uint32_t *)(rem + s);
    uint32_t *M = (uint32_t *)(m + s), *V = (uint32_t *)(v + s);
    const float *G = g + s;
    #pragma omp parallel for simd schedule(static) num_threads(threads)
    for (int64_t k = 0; k < pairs; k++) {
        uint32_t w2 = W[k], r2 = R[k], m2 = M[k], v2 = V[k];
        float me = from_bf16(m2 << 16), mo = from_bf16(m2 & 0xFFFF0000u);
        float ve = from_bf16(v2 << 16), vo = from_bf16(v2 & 0xFFFF0000u);
        uint32_t ue = adam1((w2 << 16) | (r2 & 0xFFFFu), G[2 * k] * gscale, &me, &ve,
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);
        uint32_t uo = adam1((w2 & 0xFFFF0000u) | (r2 >> 16), G[2 * k + 1] * gscale, &mo, &vo,
                            b1, b2, omb1, omb2, step, bc2s, eps, decay);
        W[k] = (ue >> 16) | (uo & 0xFFFF0000u);
        R[k] = (ue & 0xFFFFu) | (uo << 16);
        M[k] = to_bf16(me) | (to_bf16(mo) << 16);
        V[k] = to_bf16(ve) | (to_bf16(vo) << 16);
    }
    if ((n - s) & 1) {
        int64_t i = n - 1;
        uint32_t u = adam1h(((uint32_t)w[i] << 16) | rem[i], g[i] * gscale, &m[i], &v[i], b1, b2,
                            omb1, omb2, step, bc2s, eps, decay);
        w[i] = (uint16_t)(u >> 16);
        rem[i] = (uint16_t)u;
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


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    # -fno-math-errno lets the compiler vectorise sqrtf (with errno it is a library call per
    # element and the loop stays scalar); it changes no result. The 16-bit arrays are read as
    # 32-bit words, hence -fno-strict-aliasing.
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fno-strict-aliasing", "-fopenmp",
             "-fPIC", "-shared"]
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
    for f in (lib.adamw_bf16_rem, lib.adamw_bf16_rem_bf16m):
        f.restype = None
        f.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 10 + [ctypes.c_int]
    return lib


def native_available() -> bool:
    """Whether the compiled kernel is in use (compiling it on first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("SLIDEFORMER_NO_NATIVE_ADAM") != "1":
            _lib = _build()
    return _lib is not None


def fused_update(w, rem, g, m, v, lr, b1, b2, eps, wd, step, gscale) -> None:
    """AdamW step on contiguous 1-D views: w bf16, rem int16, g fp32, m/v fp32 or bf16 (in
    place)."""
    fn = _lib.adamw_bf16_rem if m.dtype == torch.float32 else _lib.adamw_bf16_rem_bf16m
    fn(w.data_ptr(), rem.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                        w.numel(), lr, b1, b2, 1 - b1, 1 - b2, eps, wd, 1 - b1 ** step,
                        1 - b2 ** step, gscale, THREADS)


def _default_threads() -> int:
    """OpenMP threads of the update: SLIDEFORMER_ADAM_THREADS, else two per core but one core.

    The loop waits on memory, so two threads per core hide latency: on the reference 16-core
    Xeon 30 threads update 4.1 G params/s against 3.6 with 15 (benchmarks/RESULTS.md), and a
    3B-model step at 64K tokens ran 8% faster. One core's worth is left to the thread that
    drives the GPU, whose kernel launches must not queue behind the update.
    """
    env = os.environ.get("SLIDEFORMER_ADAM_THREADS")
    return int(env) if env else max(1, 2 * (torch.get_num_threads() - 1))


THREADS = _default_threads()
