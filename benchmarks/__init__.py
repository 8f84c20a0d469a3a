"""Benchmark scripts (`python -m benchmarks.NAME`); each prints its figures and writes raw results under
`benchmarks/results/`."""
