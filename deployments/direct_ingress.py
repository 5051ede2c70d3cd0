"""Serve's direct ingress: each gateway replica serves HTTP on its own port, no proxy hop.

Ray Serve 2.60 has a feature flag, `RAY_SERVE_ENABLE_DIRECT_INGRESS=1`, under which every
replica of an ingress deployment runs its own uvicorn server on a port the Serve controller
allocates (30000-31000 by default) on the host given in `http_options` (127.0.0.1 here). The
regular proxy on `http_options.port` keeps working alongside. Measured on this machine
(docs/benchmarks.md): a trivial GET costs ~2.5 ms direct vs ~10 ms through the default proxy,
which is most of the gateway's added latency on the TTFT of short requests.

The flag must be in the environment of every Ray process (controller and replicas), i.e. set
before a local Ray starts; `enable_env` does that for clusters this process starts. When joining
an existing cluster the flag is whatever that cluster was started with, and `urls` returns []
if direct ingress is off there. `urls` reads the controller's target groups, the list Serve
itself hands to external load balancers.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

FLAG = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
# On a graceful stop an ingress replica waits at least this long so that external load
# balancers can notice (30 s by default); `raycluster down` should not wait that long.
DRAIN = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def enable_env(env: dict | None = None, drain_s: float = 2.0) -> dict:
    """Set the flags in `env` (os.environ by default), keeping values the user already set."""
    env = os.environ if env is None else env
    env.setdefault(FLAG, "1")
    env.setdefault(DRAIN, str(drain_s))
    return env


def urls(app_name: str, host: str = "127.0.0.1") -> list[str]:
    """`http://host:port` of every running gateway replica of `app_name` ([] without direct ingress).

    Replicas bind `http_options.host`; when that is a loopback address the URL uses it, since
    the target's ip is the node's address, which a loopback-bound server does not answer on.
    """
    try:
        from ray.serve.context import _get_global_client

        details = _get_global_client().get_serve_details()
    except Exception as e:          # Serve not started, or an API change in a newer Ray
        log.warning("direct ingress: cannot read Serve's target groups: %s", e)
        return []
    out = []
    for group in details.get("target_groups", []):
        if group.get("app_name") != app_name or not str(group.get("protocol", "")).upper().endswith("HTTP"):
            continue
        for t in group.get("targets", []):
            # Without direct ingress the targets are the proxies, on the configured port.
            if t.get("name", "").startswith("SERVE_REPLICA"):
                ip = host if host in ("127.0.0.1", "localhost", "::1") else t["ip"]
                out.append(f"http://{ip}:{t['port']}")
    return sorted(out)
