"""Benchmark and training data helpers."""
