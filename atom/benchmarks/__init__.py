"""The serving benchmark client (`python -m atom.benchmarks.benchmark_serving`),
shipped with the package; the offline benchmarks live in the repository's
`benchmarks/` (docs/performance.md)."""
