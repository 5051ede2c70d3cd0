"""Free loopback ports that a Ray node started afterwards will not take.

`bind(0)` hands out a port from the kernel's ephemeral range, and so do Ray's own processes
for their random ports; Ray's dashboard agent also takes the fixed 52365, inside that range. A
port picked with `bind(0)` and bound later (Serve's proxy, a gloo rendezvous) can be taken in
between by a Ray process started meanwhile (a flaky "Failed to bind to address"). `free_port`
picks from the ports between Ray's worker ports (10002-19999) and the ephemeral range instead,
which no process gets unless it asks for that exact port.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 20000                    # above Ray's default worker ports (10002-19999)
_EPHEMERAL = (32768, 60999)       # Linux's default ip_local_port_range
_TRIES = 200


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A port bindable on `host` now, outside the ephemeral range when it leaves room; else (an
    ephemeral range that covers everything from 20000) one the kernel picks."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    if low - _FLOOR >= 1000:
        for _ in range(_TRIES):
            port = rng.randrange(_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
