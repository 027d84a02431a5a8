"""Kernels: each op has a pure-PyTorch reference (CPU and tests) and, where it pays, Triton."""
