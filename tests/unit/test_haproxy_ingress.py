"""`raycluster up --haproxy` without a cluster: the environment it gives Ray (HAProxy's flag, the
direct ingress it forwards to, its files in the caller's directory, the user's own values kept),
the note on its two all-interface listeners, and the combinations the CLI refuses."""

from __future__ import annotations

import pytest

from deployments import haproxy_ingress
from deployments.launcher import serve_cluster
from raycluster.cli import main


def test_enable_env_sets_haproxy_and_direct_ingress_with_files_in_the_given_dir(tmp_path):
    env = haproxy_ingress.enable_env(tmp_path, {})
    assert env == {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2.0",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(tmp_path / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(tmp_path / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(tmp_path),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(tmp_path / "server-state"),
    }


def test_enable_env_keeps_what_the_user_set(tmp_path):
    env = haproxy_ingress.enable_env(tmp_path, {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "/srv/hap.cfg",
                                                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "30"})
    assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] == "/srv/hap.cfg"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "30"
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == str(tmp_path / "admin.sock")


def test_the_listeners_note_names_the_ports_in_use():
    assert "stats (port 8404) and Prometheus (port 9101)" in haproxy_ingress.listeners_note({})
    note = haproxy_ingress.listeners_note({"RAY_SERVE_HAPROXY_STATS_PORT": "18404",
                                           "RAY_SERVE_HAPROXY_METRICS_PORT": "19101"})
    assert "stats (port 18404) and Prometheus (port 19101)" in note and "every interface" in note


@pytest.mark.parametrize("extra", [["--address", "10.0.0.1:6379"], ["--no-direct-ingress"]],
                         ids=["address", "no-direct-ingress"])
def test_up_refuses_haproxy_where_it_cannot_apply(extra, capsys):
    assert main(["up", "--haproxy", *extra]) == 2
    assert "--haproxy is for a cluster `up` starts" in capsys.readouterr().err


def test_the_launcher_refuses_haproxy_on_a_joined_cluster_before_touching_ray():
    with pytest.raises(ValueError, match="haproxy: only for a cluster `up` starts"):
        serve_cluster(None, None, None, "127.0.0.1", 8000, address="10.0.0.1:6379", haproxy=True)
