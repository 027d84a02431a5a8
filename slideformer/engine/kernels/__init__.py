"""Kernels: each op has a pure-PyTorch reference (CPU and tests) and, where it pays, Triton."""

IGNORE = -100
"""The label of a token that is not trained (PyTorch's cross-entropy ``ignore_index``)."""
