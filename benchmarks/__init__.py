"""Benchmarks: `python -m benchmarks {kernels,eager,block}`."""
