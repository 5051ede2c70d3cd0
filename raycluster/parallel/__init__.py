"""Parallel worker groups: KV-cache parallelism (KVP) and stream pipeline parallelism (SPP)."""
