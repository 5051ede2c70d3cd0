"""Benchmarks: scheduler decision time (`policy_bench`)."""
