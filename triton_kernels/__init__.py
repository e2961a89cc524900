"""Triton kernels for compression and error feedback, each beside its torch reference."""
