"""An instance waits through a slow router on the same call (raycluster.cluster.router_calls):
a poll's reply is not lost and a push is not delivered twice, however slow the router."""

import asyncio
import time

import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from raycluster.cluster.router_calls import await_router

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
class SlowRouter:
    """Answers after `delay_s`; counts the calls it ran."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.pushes = 0
        self.polls = 0

    async def push(self, report) -> None:
        await asyncio.sleep(self.delay_s)
        self.pushes += 1

    async def poll(self, instance_id: str) -> list[str]:
        await asyncio.sleep(self.delay_s)
        self.polls += 1
        return [f"work-{self.polls}"]       # taken out of the outbox: only this reply holds it

    def counts(self) -> tuple[int, int]:
        return self.pushes, self.polls


def test_a_slow_router_is_waited_for_on_the_same_call(ray_cluster):
    router = SlowRouter.remote(0.6)
    t0 = time.monotonic()
    assert await_router(router.poll.remote("i0"), "i0", patience_s=0.1, max_wait_s=30) == ["work-1"]
    await_router(router.push.remote("report"), "i0", patience_s=0.1, max_wait_s=30)
    assert time.monotonic() - t0 >= 1.2
    assert ray.get(router.counts.remote()) == (1, 1)      # each call ran once; its reply was read


def test_waiting_is_bounded_and_a_dead_router_fails_at_once(ray_cluster):
    router = SlowRouter.remote(5.0)
    t0 = time.monotonic()
    with pytest.raises(GetTimeoutError):
        await_router(router.poll.remote("i0"), "i0", patience_s=0.1, max_wait_s=0.35)
    assert time.monotonic() - t0 < 3.0
    ref = router.poll.remote("i0")
    ray.kill(router)
    t0 = time.monotonic()
    with pytest.raises(RayActorError):
        await_router(ref, "i0", patience_s=0.5, max_wait_s=30)
    assert time.monotonic() - t0 < 10.0
