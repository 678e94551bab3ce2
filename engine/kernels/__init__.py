"""Fused GPU kernels (Triton) for the CUDA path, each with a pure-torch reference of the same semantics."""
