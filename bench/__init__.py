"""Benchmarks, and the simulators they run on (importable for their tests)."""
