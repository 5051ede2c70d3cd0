"""Which KV heads and experts each rank of a tensor-parallel group holds (the placement rules
raycluster.parallel.shard cuts tensors by, and TP / KVP leaders gather KV by)."""

from __future__ import annotations


def kv_split(num_kv_heads: int, tp: int) -> tuple[int, int]:
    """(KV heads each rank holds, ranks holding each KV head) over `tp` ranks: num_kv_heads / tp
    heads per rank, each on one rank; or, when tp > num_kv_heads (vLLM's replication), one head
    per rank, each on tp / num_kv_heads consecutive ranks."""
    if tp <= num_kv_heads:
        return num_kv_heads // tp, 1
    return 1, tp // num_kv_heads


def kv_heads_of(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank `rank` of `tp` holds: a contiguous block of count
    heads, or with replication the one head rank // (tp / num_kv_heads). Its query heads
    (a contiguous num_attention_heads / tp of them) all read these heads under GQA."""
    per, replicas = kv_split(num_kv_heads, tp)
    return (rank // replicas) * per, per


def kv_holder(num_kv_heads: int, tp: int, rank: int) -> bool:
    """Whether rank `rank` is the first of the ranks holding its KV heads (every rank without
    replication): the one a whole block's heads are gathered from."""
    return rank % kv_split(num_kv_heads, tp)[1] == 0


def expert_range(num_experts: int, tp: int, rank: int) -> range:
    """The experts rank `rank` of `tp` holds whole under expert parallelism: a contiguous share."""
    per = num_experts // tp
    return range(rank * per, (rank + 1) * per)
