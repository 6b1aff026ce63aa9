"""Benchmarks and profilers of the engine (not imported by the library)."""
