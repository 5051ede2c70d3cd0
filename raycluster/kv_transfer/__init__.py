"""KV-cache handoff between a prefill instance and a decode instance.

`make_connector(name, kv_cache, **opts)` builds one of "nixl", "torch_dist", "object_store"
around an engine's KV tensor [L, N, 2, B, Hkv, D]; see base.py for the protocol every connector
follows (offer -> pull -> release, leases, recompute|fail fallback). Transports are imported
lazily, so a missing optional extra (nixl) only fails when that connector is asked for.
"""

from __future__ import annotations

import importlib

import torch

from raycluster.kv_transfer.base import (KVConnector, KVHandle, KVLayoutError, KVTransferError,
                                         KVTransferUnquiesced, LeaseTable, gather_blocks, pull_with_fallback,
                                         scatter_blocks)

_REGISTRY = {
    "nixl": ("raycluster.kv_transfer.nixl_connector", "NixlConnector"),
    "torch_dist": ("raycluster.kv_transfer.torch_dist_connector", "TorchDistConnector"),
    "object_store": ("raycluster.kv_transfer.object_store_connector", "ObjectStoreConnector"),
}

CONNECTORS = tuple(_REGISTRY)


def connector_class(name: str) -> type[KVConnector]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV connector {name!r}; choose from {', '.join(_REGISTRY)}")
    mod, cls = _REGISTRY[name]
    return getattr(importlib.import_module(mod), cls)


def make_connector(name: str, kv_cache: torch.Tensor, instance_id: str = "engine",
                   **opts) -> KVConnector:
    """Build the named connector; opts go to its constructor (lease_s, clock, rank, ...)."""
    return connector_class(name)(kv_cache, instance_id, **opts)


__all__ = ["CONNECTORS", "KVConnector", "KVHandle", "KVLayoutError", "KVTransferError", "KVTransferUnquiesced",
           "LeaseTable", "connector_class", "gather_blocks", "make_connector",
           "pull_with_fallback", "scatter_blocks"]
