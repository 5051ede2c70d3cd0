"""A gateway request whose reader fell behind gets the token events queued for it as one output
(vLLM's RequestOutputCollector): tokens, text and logprobs concatenated, the last event's finish,
an error event kept apart. Driven through `ClusterClient` with a scripted router."""

from __future__ import annotations

import asyncio

from raycluster.cluster.client import ClusterClient
from raycluster.cluster.messages import GatewayReply, SubmitReply, TokenEvent
from raycluster.engine.engine import RequestOutput
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams


class ScriptedRouter:
    """Accepts every request; each pull hands out the next scripted batch of events at once."""

    def __init__(self, batches: list[list[TokenEvent]]) -> None:
        self.batches = list(batches)
        self.aborted: list[str] = []

    async def submit(self, meta) -> SubmitReply:
        return SubmitReply(True, router_id="r")

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def pull(self, gateway_id: str, timeout_s: float) -> GatewayReply:
        await asyncio.sleep(0.01)
        return GatewayReply(self.batches.pop(0) if self.batches else [], router_id="r")

    async def status(self) -> dict:
        return {}


def _run(batches, read_delay_s: float, tokenizer=None) -> list[RequestOutput]:
    router = ScriptedRouter(batches)
    client = ClusterClient(router.submit, router.abort, router.pull, router.status, tokenizer=tokenizer,
                           max_model_len=2048, vocab_size=4096, eos_token_ids=(), pull_timeout_s=0.01)

    async def read() -> list[RequestOutput]:
        outs = []
        gen = client.generate("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        async for out in gen:
            outs.append(out)
            await asyncio.sleep(read_delay_s)     # a slow reader: several pulls land meanwhile
        client._pull_task.cancel()
        return outs

    return asyncio.run(asyncio.wait_for(read(), 10))


def test_events_queued_behind_a_slow_reader_arrive_as_one_output(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode(" once upon a time there was")[:4]
    assert len(ids) == 4
    events = [TokenEvent("a", [t], logprobs=[f"lp{t}"]) for t in ids[:3]] + \
        [TokenEvent("a", [ids[3]], True, "length", logprobs=[f"lp{ids[3]}"])]
    outs = _run([[events[0]], events[1:2], events[2:3], events[3:]], read_delay_s=0.2, tokenizer=tok)
    assert [o.new_token_ids for o in outs] == [ids[:1], ids[1:]]       # the first alone, then the backlog
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 4
    assert outs[-1].logprobs == [f"lp{t}" for t in ids[1:]]
    assert "".join(o.new_text for o in outs) == tok.decode(ids)


def test_a_reader_keeping_up_gets_one_output_per_event():
    events = [TokenEvent("a", [11]), TokenEvent("a", [12]), TokenEvent("a", [13], True, "length")]
    outs = _run([[e] for e in events], read_delay_s=0.0)
    assert [o.new_token_ids for o in outs] == [[11], [12], [13]]


def test_an_error_after_tokens_is_not_merged_into_them():
    events = [TokenEvent("a", [11]), TokenEvent("a", [12]), TokenEvent("a", [], True, "error", "instance lost")]
    outs = _run([events[:1], events[1:]], read_delay_s=0.2)
    assert [o.new_token_ids for o in outs] == [[11], [12], []]
    assert outs[-1].finish_reason == "error"
