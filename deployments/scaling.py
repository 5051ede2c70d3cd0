"""Deploys the cluster application as a Serve config and resizes one pool of a running cluster.

`deploy` applies the application declaratively (the same document a Serve config YAML holds:
`import_path: deployments.app:build_app` plus the resolved `args`), the way `serve run
CONFIG.yaml` and KubeRay's RayService do. Serve then derives the app's code version from the
import path and args, so `scale` — which re-applies the config the controller last applied
with one override, `deployments: [{name: pool-ROLE, num_replicas: N}]` — is a lightweight update:
replicas already running keep their engines, KV and requests; new replicas register with the
router on their first poll; removed replicas stop, tell the router, and their requests resume
elsewhere from prompt + delivered tokens. (`serve.run` of a built app would give every
deployment a new random version and restart every replica.)

Reads and writes go through the Serve controller's client (`ray.serve.context`), as Serve's own
CLI does; the caller must be connected to the cluster's Ray.
"""

from __future__ import annotations

import copy
import time

IMPORT_PATH = "deployments.app:build_app"
POOL_PREFIX = "pool-"


def pool_deployment(role: str) -> str:
    """The Serve deployment name of pool `role` (the app builder names its pools so)."""
    return POOL_PREFIX + role


def app_document(name: str, route_prefix: str, args: dict) -> dict:
    """One application of a Serve config (ServeApplicationSchema fields)."""
    return {"name": name, "route_prefix": route_prefix, "import_path": IMPORT_PATH, "args": args}


def _client():
    from ray.serve.context import _get_global_client

    return _get_global_client()


def deploy(app: dict, http_options: dict) -> None:
    """Apply one application (see `app_document`) on the running Serve instance."""
    from ray.serve.schema import ServeDeploySchema

    doc = ServeDeploySchema.model_validate({"http_options": http_options, "applications": [app]})
    _client().deploy_apps(doc)


def deployed_app(app_name: str) -> dict:
    """The application config the controller last applied for `app_name`."""
    details = _client().get_serve_details()
    app = details.get("applications", {}).get(app_name)
    if not app or not app.get("deployed_app_config"):
        raise LookupError(f"no application {app_name!r} deployed from a config on this cluster "
                          f"(found: {sorted(details.get('applications', {}))})")
    return app["deployed_app_config"]


def replica_counts(app_name: str) -> dict[str, int]:
    """RUNNING replicas per pool role of `app_name`, from the Serve controller."""
    details = _client().get_serve_details()
    deps = details.get("applications", {}).get(app_name, {}).get("deployments", {})
    out = {}
    for name, d in deps.items():
        if name.startswith(POOL_PREFIX):
            out[name.removeprefix(POOL_PREFIX)] = sum(1 for r in d.get("replicas", [])
                                                  if r.get("state") == "RUNNING")
    return out


def scaled(app: dict, role: str, num_replicas: int) -> dict:
    """`app` (a deployed application config) with pool `role` set to `num_replicas`."""
    deployed = [p for p in (app.get("args") or {}).get("pools", [])     # as ClusterConfig.deployed_pools
                if p.get("instances", 1) > 0 or p.get("autoscaling")]
    pools = [p.get("role") for p in deployed]
    if role not in pools:
        raise ValueError(f"POOL: this cluster has no pool {role!r} (pools: {', '.join(pools)})")
    if num_replicas < 1:
        raise ValueError(f"N: a pool needs at least 1 instance, got {num_replicas}")
    auto = next(p.get("autoscaling") for p in deployed if p.get("role") == role)
    if auto:
        raise ValueError(f"POOL: pool {role!r} autoscales (min_instances {auto.get('min_instances', 1)}, "
                         f"max_instances {auto.get('max_instances')}): Serve's autoscaler sets its size from "
                         "the router's load; change its pools[].autoscaling bounds in the app config and "
                         "re-deploy it instead")
    out = copy.deepcopy(app)
    name = pool_deployment(role)
    deps = [d for d in out.get("deployments") or [] if d.get("name") != name]
    prev = next((d for d in out.get("deployments") or [] if d.get("name") == name), {})
    deps.append({**prev, "name": name, "num_replicas": num_replicas})
    out["deployments"] = deps
    return out


def scale(app_name: str, role: str, num_replicas: int, http_options: dict | None = None) -> dict:
    """Resize one pool of the running application; returns the applied application config."""
    app = scaled(deployed_app(app_name), role, num_replicas)
    details = _client().get_serve_details()
    http = http_options or {k: v for k, v in (details.get("http_options") or {}).items()
                            if k in ("host", "port")}
    deploy(app, http)
    return app


def wait_replicas(app_name: str, role: str, num_replicas: int, timeout_s: float,
                  poll_s: float = 1.0) -> bool:
    """Block until pool `role` has exactly `num_replicas` RUNNING replicas (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if replica_counts(app_name).get(role) == num_replicas:
            return True
        time.sleep(poll_s)
    return False


def applied(app: dict, args: dict, replace: bool) -> dict:
    """`app` (a deployed application config) running `args`: with `replace` (a whole app file
    given) its per-deployment overrides go too, else they stay (pools resized by `scale`)."""
    out = copy.deepcopy(app)
    out["args"] = args
    if replace:
        out.pop("deployments", None)
    return out


def wait_applied(app_name: str, app: dict, timeout_s: float, poll_s: float = 1.0) -> str:
    """Block until the controller runs `app` for `app_name` (its config applied and the app
    RUNNING) or fails to; returns the app's last status (RUNNING, DEPLOY_FAILED, ...)."""
    deadline, status = time.monotonic() + timeout_s, "UNKNOWN"
    while time.monotonic() < deadline:
        details = _client().get_serve_details().get("applications", {}).get(app_name, {})
        status = details.get("status", "UNKNOWN")
        if (details.get("deployed_app_config") or {}).get("args") == app["args"] and \
                status in ("RUNNING", "DEPLOY_FAILED", "UNHEALTHY"):
            return status
        time.sleep(poll_s)
    return status

