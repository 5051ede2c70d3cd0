"""A `RouterCore` behind one lock with the callables `ClusterClient` and `InstanceWorker` take, so
the gateway, router and instance paths run in one process without Ray (RouterCore is not
thread-safe; the actor serialises calls the same way). Shared by the no-Ray cluster tests."""

from __future__ import annotations

import asyncio
import threading
import time

from raycluster.cluster.router_lora import load_everywhere, unload_everywhere


class Switchboard:
    """The router's methods behind one lock (RouterCore is not thread-safe), with the router
    swappable for a fresh one, as a restarted actor would be."""

    def __init__(self, make_core) -> None:
        self.make_core, self.lock = make_core, threading.Lock()
        self.core, self.incarnation = make_core("0001"), 1

    def restart(self) -> None:
        with self.lock:
            self.incarnation += 1
            self.core = self.make_core(f"{self.incarnation:04d}")

    def poll(self, iid, stats, timeout):
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                reply = self.core.on_poll(iid, stats)
            if reply.work or reply.aborts or reply.releases or reply.lora is not None or \
                    time.monotonic() > deadline:
                return reply
            time.sleep(0.005)

    def push(self, report):
        with self.lock:
            self.core.on_report(report)

    async def submit(self, meta):
        with self.lock:
            return self.core.submit(meta)

    async def abort(self, rid):
        with self.lock:
            return self.core.abort(rid)

    async def pull(self, gid, timeout):
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self.core.has_events(gid) or time.monotonic() > deadline:
                    return self.core.take_events(gid)
            await asyncio.sleep(0.005)

    async def status(self):
        with self.lock:
            return self.core.status()

    # The router actor's LoRA adapter calls (the actor runs the same functions on its event loop).
    async def lora_names(self):
        with self.lock:
            return dict(self.core.adapters.served)

    async def load_lora(self, name, path, timeout_s=30.0):
        return await load_everywhere(self.core, name, path, timeout_s, lock=self.lock)

    async def unload_lora(self, name):
        with self.lock:
            return unload_everywhere(self.core, name)
