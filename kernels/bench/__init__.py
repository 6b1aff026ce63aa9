"""Benchmarks and tuners of the kernels (not imported by the library)."""
