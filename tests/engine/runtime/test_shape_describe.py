"""ExecShape.describe: the executor's choices in the line a run's log starts with."""
from __future__ import annotations

from slideformer.engine.runtime.shapes import ExecShape


def test_a_plain_shape_names_slots_and_checkpoints_only():
    assert ExecShape(4, 1024, 2, 4).describe() == "4 slots, checkpoints on the GPU"


def test_every_choice_is_named_with_its_count():
    s = ExecShape(4, 1024, 2, 1, checkpoints="host", gpu_checkpoints=3, device_update=True,
                  device_layers=1, spec_layers=9, regen_layers=2, ff_tokens=16384)
    assert s.describe() == (
        "1 slot, checkpoints on the host (those of the top 3 on the GPU), 1 decoder layer "
        "updated on the GPU, 9 speculative layers, 2 regenerated layers, embedding and head "
        "updated on the GPU, tiles of 16,384 tokens")


def test_the_cpu_backend_is_named_as_such():
    s = ExecShape(4, 1024, 2, 2, device_update=True)
    assert s.describe("CPU") == "2 slots, checkpoints on the CPU, embedding and head updated on the CPU"
