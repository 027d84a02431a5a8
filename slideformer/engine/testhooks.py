"""Test hooks: named points inside the engine's writers where a crash test can stop the process.

Inert unless the environment variable is set (one dictionary look-up per point reached):

``SLIDEFORMER_TEST_PAUSE_AT=<point>@<n>``
    The n-th time this process reaches ``point`` (counted from 1), it writes
    ``test hook: paused at <point>@<n>`` to stderr and sleeps for :data:`PAUSE_S`, so that a test
    can SIGKILL it at exactly that moment of a write (tests/engine/train/test_kill_matrix.py).

The points, in the order a run reaches them:

=====================  ============================================================================
``store.append``       token cache: a batch's token ids written to ``tokens.bin``, its mask not yet
``cache.entry``        token cache: an entry's files complete under its temporary name, before
                       ``meta.json`` and the rename
``checkpoint.file``    before each file of a checkpoint is created in ``.step-N.tmp``
``checkpoint.tensor``  after each tensor of a checkpoint file (the file is part-written)
``checkpoint.commit``  every file of ``.step-N.tmp`` written, before the rename to ``step-N``
``checkpoint.rotate``  the new checkpoint in place, before an older one is set aside
``checkpoint.delete``  an older checkpoint renamed ``.step-N.old``, before it is deleted
``export.item``        final export: after each item's tensors (shards in ``final.partial``)
``merged.item``        merged LoRA export: after each item's tensors
``adapter.file``       adapter export: the weights written in ``final.partial``, nothing else yet
``publish.start``      an exported folder complete in ``<name>.partial``, before it is renamed
``publish.swap``       the previous export renamed ``<name>.old``, the new one not yet in place
=====================  ============================================================================

``SLIDEFORMER_TEST_SLOW_IO`` (seconds), the checkpoint writer's older hook, is documented in
:mod:`slideformer.engine.train.checkpoint`.
"""
from __future__ import annotations

import os
import sys
import time

PAUSE_S = 600.0
"""How long a paused process sleeps: far longer than a test waits before it kills it."""
_reached: dict[str, int] = {}


def pause_at(point: str) -> None:
    """Reach ``point``: pause here when ``SLIDEFORMER_TEST_PAUSE_AT`` names this visit."""
    wanted = os.environ.get("SLIDEFORMER_TEST_PAUSE_AT")
    if not wanted:
        return
    n = _reached[point] = _reached.get(point, 0) + 1
    if wanted == f"{point}@{n}":
        sys.stderr.write(f"test hook: paused at {wanted}\n")
        sys.stderr.flush()
        time.sleep(PAUSE_S)
