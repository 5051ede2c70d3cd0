"""Starts and stops the cluster application for `raycluster up` (foreground).

Reads a Serve config YAML (`deployments/local.yaml` by default), applies the CLI overrides
(model, policy, host, port), connects to Ray (a new local cluster, or `--address`), runs the
application and waits until the gateway's /health answers; then blocks until SIGTERM/SIGINT
and tears down what it started: the Serve application, the router actor, and the local Ray
cluster if it created one. A local cluster runs with Serve's direct ingress on (see
`deployments/direct_ingress.py`): the gateway answers on the configured port through Serve's
proxy and, without the proxy hop, on each replica's own port, which `up` prints. With `haproxy`
(`deployments/haproxy_ingress.py`) HAProxy takes the proxy's place on the configured port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import yaml

DEFAULT_APP = Path(__file__).with_name("local.yaml")


def load_app_spec(path: str | None) -> dict:
    """The first application of a Serve config file, with http_options."""
    p = Path(path) if path else DEFAULT_APP
    if not p.is_file():
        alt = Path(__file__).parent / Path(path or "").name
        if not alt.is_file():
            raise FileNotFoundError(f"--app: no such Serve config {path!r}")
        p = alt
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(p.read_text())
    ServeDeploySchema.model_validate(doc)      # reject a malformed file before starting anything
    app = doc["applications"][0]
    return {"name": app.get("name", "raycluster"), "route_prefix": app.get("route_prefix", "/"),
            "args": dict(app.get("args") or {}), "http": dict(doc.get("http_options") or {}), "path": str(p)}


def wait_healthy(url: str, timeout_s: float, alive=lambda: True) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def override_args(args: dict, model: str | None, policy: str | None, prefix_caching: bool | None,
                  tool_call_parser: str | None = None, served_model_name: list[str] | None = None,
                  engine: dict | None = None) -> dict:
    """The app's args with the CLI's overrides (`up --model/--policy/--[no-]enable-prefix-caching/
    --tool-call-parser/--served-model-name` and the engine flags, `engine`: {field: value} for every
    pool; None leaves the app's setting)."""
    args = dict(args)
    if engine:
        args["engine"] = {**args.get("engine", {}), **engine}
    if served_model_name:
        args["served_model_name"] = list(served_model_name)
    if tool_call_parser:
        args["tool_call_parser"] = tool_call_parser
    if model:
        args["model"] = model
    if policy:
        args["policy"] = policy
    if prefix_caching is not None:      # for every pool; a pool's own `engine` options still win
        args["engine"] = {**args.get("engine", {}), "enable_prefix_caching": prefix_caching}
    return args


def dashboard_hint(dashboard_url: str) -> str:
    """The dashboard's URL, and where its login token is when Ray's token auth is on (Ray 2.60
    turns it on for a local cluster and keeps the token in ~/.ray/auth_token)."""
    url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    token = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN"):
        return f"{url} (token: $RAY_AUTH_TOKEN)"
    return f"{url} (token in {token})" if Path(token).exists() else url


def serve_cluster(app_path: str | None, model: str | None, policy: str | None, host: str, port: int,
                  address: str | None = None, dashboard: bool = True, num_cpus: int = 8,
                  ready_timeout_s: float = 600.0, on_ready=None, direct_ingress: bool = True,
                  state_file: Path | None = None, prefix_caching: bool | None = None,
                  tool_call_parser: str | None = None, haproxy: bool = False,
                  served_model_name: list[str] | None = None, engine: dict | None = None) -> int:
    import ray
    from ray import serve

    from deployments import direct_ingress as di
    from deployments import haproxy_ingress
    from deployments import scaling
    from raycluster.cluster.config import ClusterConfig

    spec = load_app_spec(app_path)
    args = spec["args"] = override_args(spec["args"], model, policy, prefix_caching, tool_call_parser,
                                        served_model_name, engine)
    cfg = ClusterConfig(**args)             # validate before touching Ray
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    started_ray = address is None
    if haproxy and not (started_ray and direct_ingress):
        raise ValueError("haproxy: only for a cluster `up` starts, with direct ingress on (a joined cluster "
                         f"keeps the ingress its nodes started with: {haproxy_ingress.FLAG}=1 there)")
    hap_dir = None
    if haproxy:                             # before ray.init: every Ray process inherits it
        hap_dir = tempfile.mkdtemp(prefix="rchap-", dir="/tmp")     # short: see haproxy_ingress
        haproxy_ingress.enable_env(hap_dir)
    elif started_ray and direct_ingress:
        di.enable_env()
    if started_ray:
        # address="local": always a cluster of our own, never one some other process started.
        ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                       namespace=cfg.namespace, _node_ip_address=None if address else "127.0.0.1")
    else:
        ctx = ray.init(address=address, namespace=cfg.namespace)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        http = {"host": host, "port": port}
        serve.start(http_options=http)
        # Declaratively, like `serve run CONFIG.yaml`: `raycluster scale` can then resize a pool
        # without restarting the replicas of the others (see deployments/scaling.py).
        scaling.deploy(scaling.app_document(spec["name"], spec["route_prefix"],
                                            cfg.model_dump(mode="json")), http)
        url = f"http://{host}:{port}"
        if not wait_healthy(url + "/health", ready_timeout_s, alive=lambda: not stop.is_set()):
            print(f"raycluster: the cluster did not become healthy within {ready_timeout_s:.0f} s", flush=True)
            return 1
        print(f"raycluster: serving {cfg.model} on {url} (app {spec['path']}, policy {cfg.policy}, "
              f"pools {', '.join(f'{p.role}x{p.instances}' for p in cfg.pools)})", flush=True)
        direct = di.urls(spec["name"], host) if direct_ingress else []
        if direct:
            print(f"raycluster: gateway replicas without the proxy hop: {', '.join(direct)}", flush=True)
        if haproxy:
            print(f"raycluster: HAProxy serves {url}; {haproxy_ingress.listeners_note()}", flush=True)
        if ctx.dashboard_url:
            print(f"raycluster: Ray dashboard at {dashboard_hint(ctx.dashboard_url)}", flush=True)
        if state_file is not None:      # what `raycluster scale` needs to find this cluster
            state_file.parent.mkdir(parents=True, exist_ok=True)
            state_file.write_text(json.dumps({
                "address": ray.get_runtime_context().gcs_address, "namespace": cfg.namespace,
                "app": spec["name"], "url": url, "http": http, "pid": os.getpid()}))
        if on_ready:
            on_ready(url)
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        if state_file is not None:
            state_file.unlink(missing_ok=True)
        if not started_ray:     # a shared cluster: remove only what we added
            try:
                serve.delete(spec["name"])
                ray.kill(ray.get_actor(cfg.router_name, namespace=cfg.namespace))
            except Exception:
                pass
        try:
            ray.shutdown()      # a cluster we started goes with its driver, Serve and router included
        finally:
            if hap_dir is not None:     # HAProxy is no Ray process: it outlives Ray's kill
                haproxy_ingress.stop_processes()
                shutil.rmtree(hap_dir, ignore_errors=True)
