"""Ray fixtures shared by tests/ray: one local Ray instance per session, loopback only."""

import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster (8 logical CPUs, no dashboard, 127.0.0.1, short temp dir).
    Worker processes run torch/OpenMP with one thread and gloo/UCX bound to loopback."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")   # short: Ray puts unix sockets here
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
    ctx = ray.init(num_cpus=8, include_dashboard=False, _temp_dir=temp_dir,
                   _node_ip_address="127.0.0.1", runtime_env={"env_vars": env},
                   )
    try:
        yield ctx
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
