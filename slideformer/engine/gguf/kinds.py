"""The ``--type`` choices of GGUF export (torch-free: the CLI parser lists them)."""
EXPORT_KINDS = ("f32", "bf16", "f16", "q8_0", "q4_0")
