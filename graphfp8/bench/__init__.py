"""Benchmarks: `python -m graphfp8.bench {kernels,eager,block}`."""
