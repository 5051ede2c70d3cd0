"""Waiting on a call to the router actor from an engine instance's poll and push threads.

A `ray.get` that times out does not take the call back: the call is queued at the router and
runs when the router gets to it. Calling again after a timeout would then deliver a step report
twice (the client would see its tokens twice) or lose a poll's reply (the work items in it were
taken out of the router's outbox when the first poll ran, and no one would read them). So an
instance waits on the same call through a slow router, warning every `patience_s`, and gives up
only after `max_wait_s`, or at once when the call fails (the router died: its successor starts a
new epoch and the instance re-registers).
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError

log = logging.getLogger(__name__)


def await_router(ref: ray.ObjectRef, what: str, patience_s: float = 30.0, max_wait_s: float = 600.0):
    """The result of the router call `ref`, waiting on that same call for up to `max_wait_s`."""
    start = time.monotonic()
    while True:
        try:
            return ray.get(ref, timeout=patience_s)
        except GetTimeoutError:
            waited = time.monotonic() - start
            if waited >= max_wait_s:
                raise
            log.warning("%s: the router has not answered for %.0f s; still waiting on the same call", what, waited)
