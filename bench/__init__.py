"""Benchmarks and reports: kernel benchmark (`bench.attention`), sweep report (`bench.report`),
loss-curve comparison (`bench.compare`). Each is a CLI: ``python -m bench.<name> --help``."""
