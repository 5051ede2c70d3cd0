"""LoRA adapters loaded on first use from a directory (vLLM's filesystem LoRA resolver).

With a resolver directory (`lora_resolver_dir`, or vLLM's environment variable
`VLLM_LORA_RESOLVER_CACHE_DIR`) and runtime LoRA updating allowed, a request whose `model` names
no served model or adapter is served from `<dir>/<model>` when that directory holds a PEFT
adapter (adapter_config.json): the gateway loads it as `POST /v1/load_lora_adapter` would (in
the cluster every instance loads it before it is served), then runs the request on it. Requests
that ask for the same new name at once wait for one load; one that finds the name being loaded
by someone else (another gateway replica, an admin's `/v1/load_lora_adapter`) waits for that
load instead. A name that is not a plain directory
name (a path separator, `.` or `..`, a leading dot) is never looked up, so a client cannot reach
files outside the directory. A directory whose adapter cannot be served (wrong shapes, DoRA, ...)
leaves the name unknown: the request gets the 404 a missing model gets, with the reason.

With `max_loaded`, the resolver keeps at most that many of the adapters it loaded: before
loading one more it unloads the one its gateway's requests named least recently (requests
running on it finish on it; a later request for it loads it again). Adapters served from the
start or loaded through `/v1/load_lora_adapter` are never evicted. Recency is this gateway's
view: with several gateway replicas each evicts by the requests it saw.

Unlike vLLM's resolver, the adapter's `base_model_name_or_path` is not compared with the served
model's name; `load_adapter` checks every tensor's shape against the model instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict

from raycluster.model.lora import AdapterBusy, AdapterError

RESOLVER_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"
log = logging.getLogger(__name__)


def resolver_dir(given: str | None = None) -> str | None:
    """`given` if set, else vLLM's environment variable; None when neither is."""
    return given or os.environ.get(RESOLVER_DIR_ENV) or None


class LoRAResolver:
    """`engine`: the backend's `load_lora(name, path)`; `adapters_now()`: the adapters served now
    (name -> path), to tell a lost race (another gateway loaded the name) from a failure."""

    def __init__(self, root: str, engine, adapters_now, max_loaded: int | None = None, busy_wait_s: float = 120.0,
                 poll_s: float = 0.05) -> None:
        """`max_loaded`: evict beyond this many resolved adapters (None: never); `busy_wait_s`:
        how long to wait for someone else's load of the name (`AdapterBusy`)."""
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"lora_resolver_max_loaded: {max_loaded} must be at least 1")
        self.root = os.path.realpath(root)
        self.engine, self.adapters_now = engine, adapters_now
        self.max_loaded, self.busy_wait_s, self.poll_s = max_loaded, busy_wait_s, poll_s
        self._loading: dict[str, asyncio.Future] = {}
        self.resolved: OrderedDict[str, None] = OrderedDict()      # loaded here, least recently named first

    def touch(self, name: str) -> None:
        """A request named `name`: it becomes the most recently used, if the resolver loaded it."""
        if name in self.resolved:
            self.resolved.move_to_end(name)

    def path_for(self, name: str) -> str | None:
        """`<root>/<name>` if `name` is a plain directory name there holding an adapter."""
        if not name or name.startswith(".") or os.sep in name or (os.altsep and os.altsep in name):
            return None
        path = os.path.join(self.root, name)
        if os.path.dirname(os.path.realpath(path)) != self.root:
            return None                                 # a symlink pointing elsewhere
        return path if os.path.isfile(os.path.join(path, "adapter_config.json")) else None

    async def resolve(self, name: str) -> str | None:
        """Load `name` from the directory if it is there; None when served now, else why not."""
        path = self.path_for(name)
        if path is None:
            return f"no adapter directory {name!r} in the LoRA resolver's directory"
        fut = self._loading.get(name)
        if fut is None:
            fut = self._loading[name] = asyncio.ensure_future(self._load(name, path))
            fut.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(fut)

    async def _evict(self) -> None:
        while self.max_loaded is not None and len(self.resolved) >= self.max_loaded:
            victim, _ = self.resolved.popitem(last=False)
            try:
                await self.engine.unload_lora(victim)
                log.info("LoRA resolver: unloaded %r (least recently used)", victim)
            except AdapterError:
                pass            # unloaded by someone else already

    async def _load(self, name: str, path: str) -> str | None:
        await self._evict()
        try:
            await self.engine.load_lora(name, path)
        except AdapterError as e:
            # Loaded meanwhile, or being loaded by someone else (another gateway replica): wait.
            deadline = time.monotonic() + (self.busy_wait_s if isinstance(e, AdapterBusy) else 0.0)
            while True:
                if name in await self.adapters_now():
                    self.resolved[name] = None
                    return None
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(self.poll_s)
            log.warning("LoRA resolver: %r at %s cannot be served: %s", name, path, e)
            return str(e)
        log.info("LoRA resolver: loaded %r from %s", name, path)
        self.resolved[name] = None
        return None
