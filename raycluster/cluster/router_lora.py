"""The LoRA adapters the cluster serves, kept by the router (runtime loading and unloading).

Two name -> path tables: `served`, what a new request may name, and `loaded`, what every
instance must hold: the served adapters, those being loaded, and unloaded ones that requests
still run on. Each change of `loaded` bumps `version`. An instance gets the whole `loaded`
table in a poll reply once per version (`table_for`), reconciles its engine to it between steps
(loading what it lacks, unloading what is not listed) and reports the adapters it serves, the
ones it could not load and the version it applied (`InstanceStats.lora_adapters`,
`lora_failed`, `lora_version`). A load enters `loaded` first and `served` once every instance
serves it (`progress`, then `commit`), so no request is sent where it is not loaded yet; if an
instance cannot load it, the router takes it back out (`rollback`). An unloaded adapter leaves
`served` at once and `loaded` once no request in the router uses it (`collect`), so requests
queued or running on it finish on it, wherever they run.

Plain data and no Ray: `RouterCore` owns one (`adapters`); the router actor runs
`load_everywhere` / `unload_everywhere` on its event loop (tests, with a lock around the core).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable

from raycluster.model.lora import AdapterBusy, AdapterError, AdapterNotFound

LOAD_POLL_S = 0.02      # how often a load looks at the instances' reports


class RouterAdapters:
    def __init__(self, static: dict[str, str] | None = None, restored: dict[str, str] | None = None) -> None:
        """`static`: the adapters every instance starts with (its engine's `lora_modules`).
        `restored`: the table a restarted router saved before (it then differs from what
        instances started with, so every instance is sent it)."""
        self.served: dict[str, str] = dict(restored if restored is not None else static or {})
        self.loaded: dict[str, str] = dict(self.served)
        self.loading: set[str] = set()
        # Instances start on `static`: with no change since (version 0) none needs a table.
        self.version = 0 if restored is None or restored == (static or {}) else 1

    def load(self, name: str, path: str) -> None:
        """Start loading `name` on every instance (AdapterError if the name is taken)."""
        if name in self.served:
            raise AdapterError(f"the LoRA adapter {name!r} has already been loaded")
        if name in self.loaded:
            raise AdapterBusy(f"the LoRA adapter {name!r} is being loaded or unloaded; try again once that "
                              "is done")
        self.loaded[name] = path
        self.loading.add(name)
        self.version += 1

    def commit(self, name: str) -> None:
        """Every instance serves `name`: requests may name it from now on."""
        self.served[name] = self.loaded[name]
        self.loading.discard(name)

    def rollback(self, name: str) -> None:
        """Take back a load that an instance could not make (or that timed out)."""
        if name in self.loading:
            self.loading.discard(name)
            del self.loaded[name]
            self.version += 1

    def unload(self, name: str) -> None:
        if name not in self.served:
            raise AdapterNotFound(f"the LoRA adapter {name!r} cannot be found")
        del self.served[name]

    def set_static(self, old: dict[str, str], new: dict[str, str]) -> None:
        """A redeploy changed the adapters instances start with: serve the added ones, unload
        the dropped ones (`collect` then takes them out); adapters loaded at run time stay."""
        for name in old.keys() - new.keys():
            if name in self.served:
                self.unload(name)
        added = [n for n in new if n not in self.loaded]
        for name in added:
            self.served[name] = self.loaded[name] = new[name]
        if added:
            self.version += 1

    def retiring(self) -> bool:
        """Whether an unloaded adapter is still held for requests (or a load is under way)."""
        return len(self.loaded) != len(self.served) + len(self.loading)

    def collect(self, in_use: set[str | None]) -> bool:
        """Drop unloaded adapters no request uses any more from `loaded`; True if any went."""
        gone = [n for n in self.loaded if n not in self.served and n not in self.loading and n not in in_use]
        for n in gone:
            del self.loaded[n]
        if gone:
            self.version += 1
        return bool(gone)

    def table_for(self, inst) -> dict[str, str] | None:
        """The table to send `inst` (a router `Instance`) now, once per version; None if it
        has this version's already."""
        if inst.lora_sent == self.version:
            return None
        inst.lora_sent = self.version
        return dict(self.loaded)

    def pending(self, inst) -> bool:
        return inst.lora_sent != self.version

    def progress(self, name: str, instances, since: int = 0) -> tuple[list[str], dict[str, str]]:
        """For a load of `name` that made table version `since`: the instances (ids) that do not
        serve it from a table that new yet, and those that could not load it, with their error."""
        waiting, failed = [], {}
        for inst in instances:
            if inst.draining:
                continue
            error = (inst.stats.lora_failed or {}).get(name)
            if error is not None and inst.stats.lora_version == self.version:
                failed[inst.instance_id] = error
            elif name not in (inst.stats.lora_adapters or ()) or inst.stats.lora_version < since:
                waiting.append(inst.instance_id)
        return waiting, failed


async def load_everywhere(core, name: str, path: str, timeout_s: float, wake: Callable[[], None] = lambda: None,
                          lock=None) -> dict:
    """Have every instance of `core` (a RouterCore) load the adapter at `path` as `name`:
    {"ok": True} once all serve it (requests may name it from then on); else {"ok": False,
    "error": ..., "not_found": ...} and none keeps it. `wake` delivers the new table to parked
    polls; `lock` (a context manager, default none) guards each look at `core`."""
    lock = lock or contextlib.nullcontext()
    with lock:
        ad = core.adapters
        try:
            ad.load(name, path)
        except AdapterError as e:
            return {"ok": False, "error": str(e), "not_found": False, "busy": isinstance(e, AdapterBusy)}
        since = ad.version
        wake()
    deadline = time.monotonic() + timeout_s
    while True:
        with lock:
            waiting, failed = ad.progress(name, core.instances.values(), since)
            if not waiting and not failed:
                ad.commit(name)
                return {"ok": True}
            if failed or time.monotonic() >= deadline:
                ad.rollback(name)
                wake()
                if failed:
                    iid, error = next(iter(failed.items()))
                    # vLLM's rule: a path holding no adapter is a 404, any other failure a 400.
                    return {"ok": False, "error": f"{iid}: {error}", "not_found": "no adapter found" in error}
                return {"ok": False, "not_found": False,
                        "error": f"{name}: instances {waiting} did not load it within {timeout_s:g} s"}
        await asyncio.sleep(LOAD_POLL_S)


def unload_everywhere(core, name: str, wake: Callable[[], None] = lambda: None) -> dict:
    """New requests may no longer name `name`; the instances drop it once no request in the
    router uses it. {"ok": True}, or {"ok": False, "error": ..., "not_found": True}."""
    try:
        core.adapters.unload(name)
    except AdapterError as e:
        return {"ok": False, "error": str(e), "not_found": True}
    core.collect_adapters()
    wake()
    return {"ok": True}
