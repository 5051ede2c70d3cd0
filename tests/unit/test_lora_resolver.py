"""The LoRA resolver's races (raycluster/server/lora_resolver.py), without HTTP: a name another
party is loading (the router answers "busy") is waited for, not refused; a failed load is
refused at once; the router marks an in-progress load of the name as busy."""

from __future__ import annotations

import asyncio

import pytest

from raycluster.cluster.router_lora import RouterAdapters
from raycluster.model.lora import AdapterBusy, AdapterError
from raycluster.server.lora_resolver import LoRAResolver


class FakeBackend:
    """load_lora raises `error`; the name shows up as served after `appears_after_s` (someone
    else's load finishing), or never."""

    def __init__(self, error: AdapterError, appears_after_s: float | None) -> None:
        self.error, self.appears_after_s, self.calls = error, appears_after_s, 0
        self.t0 = None

    async def load_lora(self, name: str, path: str) -> None:
        self.calls += 1
        self.t0 = asyncio.get_running_loop().time()
        raise self.error

    async def adapters_now(self) -> dict[str, str]:
        loop_t = asyncio.get_running_loop().time()
        done = self.appears_after_s is not None and loop_t - self.t0 >= self.appears_after_s
        return {"sql": "/x/sql"} if done else {}


def _resolver(tmp_path, backend, **kw) -> LoRAResolver:
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    return LoRAResolver(str(tmp_path), backend, backend.adapters_now, poll_s=0.01, **kw)


def test_a_name_someone_else_is_loading_is_waited_for(tmp_path):
    backend = FakeBackend(AdapterBusy("the LoRA adapter 'sql' is being loaded"), appears_after_s=0.1)
    assert asyncio.run(_resolver(tmp_path, backend).resolve("sql")) is None
    assert backend.calls == 1


def test_a_busy_name_that_never_appears_gives_up_after_the_wait(tmp_path):
    backend = FakeBackend(AdapterBusy("the LoRA adapter 'sql' is being loaded"), appears_after_s=None)
    why = asyncio.run(_resolver(tmp_path, backend, busy_wait_s=0.1).resolve("sql"))
    assert why == "the LoRA adapter 'sql' is being loaded"


def test_a_failed_load_is_refused_at_once(tmp_path):
    backend = FakeBackend(AdapterError("sql: use_dora is not supported"), appears_after_s=0.05)
    why = asyncio.run(_resolver(tmp_path, backend).resolve("sql"))
    assert why == "sql: use_dora is not supported"


def test_the_router_calls_a_load_in_progress_busy():
    ad = RouterAdapters()
    ad.load("sql", "/a/sql")
    with pytest.raises(AdapterBusy):
        ad.load("sql", "/a/sql")
    ad.commit("sql")
    with pytest.raises(AdapterError) as e:
        ad.load("sql", "/a/sql")
    assert not isinstance(e.value, AdapterBusy)          # served already: not a wait


def test_a_second_load_of_a_name_being_loaded_answers_busy():
    from types import SimpleNamespace

    from raycluster.cluster.router_lora import load_everywhere

    core = SimpleNamespace(adapters=RouterAdapters(), instances={})
    core.adapters.load("sql", "/a/sql")             # a load under way
    reply = asyncio.run(load_everywhere(core, "sql", "/a/sql", timeout_s=1.0))
    assert reply["ok"] is False and reply["busy"] is True
