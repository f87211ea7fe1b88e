"""Fused kernels: the LM head and cross-entropy over chunks of tokens (fused_ce.py; Triton on CUDA)."""
