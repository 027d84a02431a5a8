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
as PyTorch's bf16 cast does (8 bytes fewer each way). With 8-bit moments (``"int8"``) a third
entry point updates an item block by block (dequantise m and v, AdamW, requantise: see
slideformer.engine.runtime.moments8; 10 bytes read and 6 written per parameter). The C source (``cpu_adam.c``) is compiled with
the system C compiler into a private folder of the user cache (a fraction of a second), keyed by
source, compiler, flags and CPU features; without a compiler the update falls back
to the chain of PyTorch ops in ``slideformer.engine.runtime.host_state.adam_update`` (the reference: several
passes through a cache-sized scratch, slower, same results to rounding).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE_FILE = Path(__file__).with_name("cpu_adam.c")
"""The kernel's C source, shipped as package data and compiled on first use."""

_lib = None
_tried = False
BUILD_ERROR = ""
"""The compiler's message when the kernel could not be built (the fallback is then in use)."""


def _cache_dir() -> Path:
    try:
        from platformdirs import user_cache_dir
        return Path(user_cache_dir("slideformer")) / "kernels"
    except ImportError:  # the kernel still builds without platformdirs
        return Path(tempfile.gettempdir()) / f"slideformer-kernels-{_uid()}"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _private(folder: Path) -> bool:
    """Create ``folder`` readable and writable by this user only; False when it is someone
    else's or others may write to it (a library from there could be anybody's code)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not hasattr(os, "getuid"):  # Windows: the user's cache folder is private already
        return True
    st = folder.stat()
    if st.st_uid != os.getuid():
        return False
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return True


def cpu_features() -> str:
    """What the compiled code depends on besides its source and flags: ``-march=native``
    code built on one CPU can crash another (SIGILL) when a cache folder is shared."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, arm
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.split("\n", 1)[0]
    except (OSError, subprocess.SubprocessError):
        return ""


def _build() -> ctypes.CDLL | None:
    global BUILD_ERROR
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        BUILD_ERROR = "no C compiler found (install gcc, or set CC)"
        return None
    # -fno-math-errno lets the compiler vectorise sqrtf (with errno it is a library call per
    # element and the loop stays scalar); it changes no result. The 16-bit arrays are read as
    # 32-bit words, hence -fno-strict-aliasing.
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fno-strict-aliasing", "-fopenmp",
             "-fPIC", "-shared"]
    source = SOURCE_FILE.read_text(encoding="utf-8")
    key = "\0".join([source, cc, _compiler_id(cc), " ".join(flags), cpu_features()])
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = _cache_dir()
    if not _private(folder):
        folder = Path(tempfile.mkdtemp(prefix="slideformer-kernels-"))  # 0700, this process's
    out = folder / f"cpu_adam_{tag}.so"
    if not out.is_file():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, *flags, str(SOURCE_FILE), "-o", str(tmp), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            BUILD_ERROR = f"the C compiler {cc} cannot run ({e.strerror})"
            return None
        if done.returncode != 0:
            BUILD_ERROR = done.stderr.strip()[-2000:] or f"{cc} failed"
            return None
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    for f in (lib.adamw_bf16_rem, lib.adamw_bf16_rem_bf16m):
        f.restype = None
        f.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] + [ctypes.c_float] * 10 + [ctypes.c_int]
    lib.adamw_q8.restype = None
    lib.adamw_q8.argtypes = ([ctypes.c_void_p] * 9 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                             + [ctypes.c_void_p] * 2 + [ctypes.c_float] * 10 + [ctypes.c_int])
    return lib


def native_available() -> bool:
    """Whether the compiled kernel is in use (compiling it on first call)."""
    global _lib, _tried, BUILD_ERROR
    if not _tried:
        _tried = True
        if os.environ.get("SLIDEFORMER_NO_NATIVE_ADAM") != "1":
            _lib = _build()
        else:
            BUILD_ERROR = "turned off by SLIDEFORMER_NO_NATIVE_ADAM=1"
    return _lib is not None


def unavailable_reason() -> str | None:
    """Why the PyTorch fallback does the CPU updates (None: the compiled kernel does)."""
    return None if native_available() else (BUILD_ERROR or "the kernel could not be loaded")


def fused_update(w, rem, g, m, v, lr, b1, b2, eps, wd, step, gscale, out=None) -> None:
    """AdamW step on contiguous 1-D views: w bf16, rem int16, g fp32, m/v fp32 or bf16; in
    place, or, with ``out`` = (w, rem, m, v) views of the same sizes and dtypes, into those
    (the inputs are left as they were)."""
    ow, orem, om, ov = (w, rem, m, v) if out is None else out
    if (ow.data_ptr() - w.data_ptr()) & 3:
        raise ValueError("fused_update: out must share the inputs' 4-byte alignment")
    fn = _lib.adamw_bf16_rem if m.dtype == torch.float32 else _lib.adamw_bf16_rem_bf16m
    fn(w.data_ptr(), rem.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), ow.data_ptr(),
       orem.data_ptr(), om.data_ptr(), ov.data_ptr(), w.numel(), lr, b1, b2, 1 - b1, 1 - b2, eps,
       wd, 1 - b1 ** step, 1 - b2 ** step, gscale, THREADS)


def fused_update_q8(w, rem, g, m, v, runs, lr, b1, b2, eps, wd, step, gscale, out=None) -> None:
    """AdamW step of a whole item with 8-bit block-wise moments (slideformer.engine.runtime.moments8):
    w bf16 with rem int16, or w fp32 with rem None; g fp32; m and v int8 blocks. ``runs``: the
    item's (start, end, decay) runs, decay taking ``wd``. In place, or into ``out`` = (w, rem,
    m, v) of the same sizes."""
    from slideformer.engine.runtime.moments8 import BUCKETS, TABLES
    if (rem is None) != (w.dtype == torch.float32):
        raise ValueError("fused_update_q8: bf16 weights take a remainder, fp32 ones none")
    ow, orem, om, ov = (w, rem, m, v) if out is None else out
    r = torch.tensor([(s, e, int(d)) for s, e, d in runs], dtype=torch.int64).reshape(-1, 3)
    ptr = (lambda t: 0 if t is None else t.data_ptr())
    _lib.adamw_q8(w.data_ptr(), ptr(rem), g.data_ptr(), m.data_ptr(), v.data_ptr(), ow.data_ptr(),
                  ptr(orem), om.data_ptr(), ov.data_ptr(), w.numel(), r.data_ptr(), len(r),
                  TABLES.data_ptr(), BUCKETS.data_ptr(), lr, b1, b2, 1 - b1, 1 - b2, eps, wd,
                  1 - b1 ** step, 1 - b2 ** step, gscale, THREADS)


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
