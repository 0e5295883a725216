"""Test support: fakes, simulators and helpers that tests (and benchmarks) share."""
