"""raycluster.ports: loopback ports outside the kernel's ephemeral range (where Ray's own
processes, started later, take theirs)."""

from __future__ import annotations

import socket

from raycluster import ports


def test_ports_lie_between_rays_worker_ports_and_the_ephemeral_range_and_bind():
    low, _ = ports._ephemeral_range()
    got = {ports.free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in got)
    assert 52365 not in got                   # Ray's dashboard agent's fixed port
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_given(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # Candidates: the taken port and the 999 above it.
    monkeypatch.setattr(ports, "_FLOOR", port)
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (port + 1000, 60999))
    try:
        assert all(ports.free_port() != port for _ in range(30))
    finally:
        taken.close()


def test_a_range_that_leaves_no_room_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    p = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
