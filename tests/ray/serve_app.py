"""The cluster app deployed on the session's local Ray for a test module, as `raycluster up` applies
it (Serve's declarative config with the ClusterConfig's JSON dump as args), on a free loopback port."""

from __future__ import annotations

import contextlib

import pytest

from raycluster.ports import free_port


@contextlib.contextmanager
def deployed_app(cfg: dict, router: str, healthy_within_s: float, what: str):
    """Yields the gateway's URL once `/health` answers (fails the test after `healthy_within_s`);
    then deletes the app, stops Serve and kills the router actor `router` (a detached named actor
    that would outlive the app)."""
    import ray
    from ray import serve

    from deployments import scaling
    from deployments.launcher import wait_healthy
    from raycluster.cluster.config import ClusterConfig

    port = free_port()
    http = {"host": "127.0.0.1", "port": port}
    serve.start(http_options=http)
    scaling.deploy(scaling.app_document("raycluster", "/", ClusterConfig(**cfg).model_dump(mode="json")), http)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(url + "/health", healthy_within_s):
            pytest.fail(f"{what} not healthy within {healthy_within_s:g} s")
        yield url
    finally:
        serve.delete("raycluster")
        serve.shutdown()
        try:
            ray.kill(ray.get_actor(router, namespace="raycluster"))
        except ValueError:
            pass
