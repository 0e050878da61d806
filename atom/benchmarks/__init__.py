"""Benchmark clients (`python -m atom.benchmarks.benchmark_serving`)."""
