"""`raycluster up --detach` / `status` / `down` as a user runs them, over real HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from deployments import haproxy_ingress
from raycluster.ports import free_port

pytestmark = pytest.mark.e2e

KEY = "sk-cli-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _cli(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raycluster.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _instances(env: dict, want: int, timeout_s: float = 120.0) -> list[str]:
    """Instance ids the router lists once it lists `want` of them (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    ids: list[str] = []
    while time.monotonic() < deadline:
        st = _cli("status", "--json", env=env, timeout=60)
        ids = [i["id"] for i in json.loads(st.stdout)["instances"]] if st.returncode == 0 else []
        if len(ids) == want:
            return ids
        time.sleep(1.0)
    raise AssertionError(f"router lists {ids}, wanted {want} instances")


def _check_scale(env: dict, url: str, before: list[str], text: str) -> None:
    """`scale mixed 2` adds an instance without restarting the running one; the new one serves
    the same greedy text; `scale mixed 1` removes one; a pool the app lacks is a clear error."""
    sc = _cli("scale", "mixed", "2", "--timeout", "300", env=env, timeout=400)
    assert sc.returncode == 0, sc.stdout + sc.stderr
    ids = _instances(env, 2)
    assert before[0] in ids                      # a lightweight update: the old replica kept running
    for _ in range(4):                           # load-aware dispatch reaches both in a few tries
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                                      "temperature": 0}, timeout=60, headers=AUTH)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    # Scale down under load: the replica Serve stops drains (no new work, its streams finish
    # there), so no request is resumed elsewhere (without the drain, 2 of 4 are). The streams
    # are long so that the CLI, slow to start on a busy host, stops a replica while they run.
    body = {"prompt": "once", "max_tokens": 6000, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    got: list[tuple[str, int]] = []

    def stream() -> None:
        parts, n = [], 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=400, headers=AUTH) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    parts += [c["text"] for c in chunk["choices"]]
                    n = (chunk.get("usage") or {}).get("completion_tokens", n)
        got.append(("".join(parts), n))

    resumed = json.loads(_cli("status", "--json", env=env, timeout=60).stdout)["resumed"]
    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    sc = subprocess.Popen([sys.executable, "-m", "raycluster.cli", "scale", "mixed", "1"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    drained_with_work = False                   # the stopping replica still ran streams
    deadline = time.monotonic() + 400
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        st = httpx.get(url + "/v1/cluster/status", timeout=30, headers=AUTH).json()
        drained_with_work |= any(i["draining"] and i["running"] > 0 for i in st["instances"])
        time.sleep(0.25)
    for t in threads:
        t.join(60)
    print(f"scale-down drain: the streams took {time.monotonic() - deadline + 400:.0f} s")
    assert sc.wait(400) == 0, sc.stdout.read()
    assert len(got) == 4 and len({t for t, _ in got}) == 1 and [n for _, n in got] == [6000] * 4
    assert len(_instances(env, 1)) == 1
    assert json.loads(_cli("status", "--json", env=env, timeout=60).stdout)["resumed"] == resumed
    if not drained_with_work:       # the stop came after the streams: the drain was not exercised
        print("scale-down drain: the stopped replica held no stream when it stopped")
    bad = _cli("scale", "decode", "1", env=env, timeout=120)
    assert bad.returncode == 2 and "no pool 'decode'" in bad.stderr


def _check_apply(env: dict, url: str, text: str) -> None:
    """`apply --policy fcfs` re-applies the running app in place: the router takes the policy,
    the new replicas serve the same greedy text; a bad policy is refused before anything is
    deployed, and applying what runs already changes nothing."""
    bad = _cli("apply", "--policy", "nope", env=env, timeout=120)
    assert bad.returncode == 2 and "unknown policy 'nope'" in bad.stderr, bad.stderr
    ap = _cli("apply", "--policy", "fcfs", "--timeout", "300", env=env, timeout=400)
    assert ap.returncode == 0, ap.stdout + ap.stderr
    st = json.loads(_cli("status", "--json", env=env, timeout=60).stdout)
    assert st["policy"] == "fcfs"
    r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0},
                   timeout=120, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    same = _cli("apply", "--policy", "fcfs", env=env, timeout=120)
    assert same.returncode == 0 and "nothing to change" in same.stdout


def test_up_detach_status_generate_down(tmp_path):
    """With `--api-key`: the gateway replicas (behind the proxy and on their own ports) want it,
    /health does not, and `status` sends the key from RAYCLUSTER_API_KEY. With
    `--served-model-name`: the API answers to each name."""
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rcup", dir="/tmp")      # short: Ray's unix sockets live here
    env = {**os.environ, "RAYCLUSTER_STATE_DIR": str(tmp_path), "RAY_TMPDIR": ray_tmp}
    env.pop("RAYCLUSTER_API_KEY", None)
    direct: list[str] = []
    # The default app, with room for the scale-down's drain below.
    doc = yaml.safe_load((Path(__file__).parents[2] / "deployments" / "local.yaml").read_text())
    # The drain outlasts the streams below on a busy host (two 6000-token streams on the stopped
    # replica took over 120 s during a full local run, and 2 of 4 were resumed elsewhere).
    doc["applications"][0]["args"]["drain_s"] = 300
    (tmp_path / "app.yaml").write_text(yaml.safe_dump(doc))
    up = _cli("up", "--detach", "--no-dashboard", "--port", str(port), "--policy", "edf", "--api-key", KEY,
              "--app", str(tmp_path / "app.yaml"), "--served-model-name", "tiny", "house-llm", env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        info = json.loads((tmp_path / "up.json").read_text())
        url = f"http://127.0.0.1:{port}"
        assert info["url"] == url
        body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, timeout=60, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # --served-model-name: both names listed and answered to; a response names the request's.
        models = httpx.get(url + "/v1/models", timeout=60, headers=AUTH).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "house-llm"]
        alias = httpx.post(url + "/v1/completions", json={**body, "model": "house-llm"}, timeout=60, headers=AUTH)
        assert alias.status_code == 200 and alias.json()["model"] == "house-llm"
        assert alias.json()["choices"][0]["text"] == r.json()["choices"][0]["text"] and r.json()["model"] == "tiny"
        assert _cli("status", "--json", env=env, timeout=60).returncode == 1          # no key here
        env["RAYCLUSTER_API_KEY"] = KEY
        st = _cli("status", "--json", env=env, timeout=60)
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["policy"] == "edf" and [i["role"] for i in status["instances"]] == ["mixed"]
        # Serve direct ingress: the gateway replica also answers on its own port, same API.
        direct = status["gateway_urls"]
        assert len(direct) == 1 and direct[0].startswith("http://127.0.0.1:") and direct[0] != url
        assert httpx.post(direct[0] + "/v1/completions", json=body, timeout=60).status_code == 401
        r2 = httpx.post(direct[0] + "/v1/completions", json=body, timeout=60, headers=AUTH)
        assert r2.status_code == 200 and r2.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        _check_scale(env, url, [i["id"] for i in status["instances"]], r.json()["choices"][0]["text"])
        _check_apply(env, url, r.json()["choices"][0]["text"])
    finally:
        down = _cli("down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not (tmp_path / "up.json").exists()
    for u in (url, *direct):
        with pytest.raises(httpx.HTTPError):
            httpx.get(u + "/health", timeout=3)
    try:
        os.kill(info["pid"], 0)
        alive = True
    except OSError:
        alive = False
    assert not alive


def test_up_with_haproxy_serves_on_the_port_and_down_stops_haproxy(tmp_path):
    """`up --haproxy`: HAProxy (not Serve's Python proxy) answers on --port with the gateway's
    API, and `down` stops it too (killing Ray alone would leave it running)."""
    port = free_port()
    cfg = str(tmp_path / "haproxy.cfg")
    ray_tmp = tempfile.mkdtemp(prefix="rcup", dir="/tmp")
    env = {**os.environ, "RAYCLUSTER_STATE_DIR": str(tmp_path), "RAY_TMPDIR": ray_tmp,
           "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": cfg, "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}
    env.pop("RAYCLUSTER_API_KEY", None)
    up = _cli("up", "--detach", "--no-dashboard", "--haproxy", "--port", str(port), env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        url = f"http://127.0.0.1:{port}"
        assert len(haproxy_ingress.processes(tmp_path)) == 1    # HAProxy runs our config
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        log = (tmp_path / "up.log").read_text()
        assert f"HAProxy serves {url}" in log and "bind every interface" in log
    finally:
        down = _cli("down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=3)
    assert haproxy_ingress.processes(tmp_path) == []
