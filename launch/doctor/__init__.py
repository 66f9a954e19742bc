"""Diagnostics of a node and an install: CUDA, the GPU smoke test, the install verdict."""
