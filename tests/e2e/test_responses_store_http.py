"""The Responses API's stored responses over real HTTP, read by the `openai` client: a response is
kept unless `store: false`, GET returns it as it was answered (streamed ones too), a request naming
it in `previous_response_id` continues the whole conversation (its output equal to the engine's for
the chat the turns make, the earlier instructions not carried over), DELETE forgets it, and what
names an unknown or forgotten response is a 404 naming the field. (The store's own order and
capacity: tests/unit/test_response_store.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest
from engine_http import all_free, serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams
from raycluster.server.response_store import LocalResponses, ResponseStore

pytestmark = pytest.mark.e2e

CFG = dict(kv_cache_tokens=8192, policy="fcfs", packer="token", num_threads=1)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tok = tiny_parts(tiny_model_dir)
    ref = LLMEngine(EngineConfig(**CFG), model, tok)
    with serve_engine(EngineConfig(**CFG), model, tok, response_store=LocalResponses(ResponseStore(100))) as (url, aeng):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield url, client, aeng, ref, tok


def _greedy(ref, tok, messages, n):
    return tok.decode(ref.generate([tok.apply_chat_template(messages, tokenize=True)],
                                   SamplingParams(max_tokens=n, temperature=0.0))[0])


def test_a_stored_response_continues_the_conversation(served):
    url, client, aeng, ref, tok = served
    first = client.responses.create(model="tiny", instructions="Answer briefly.", input="Tell me about the sea.",
                                    max_output_tokens=12, temperature=0)
    assert first.store is True and client.responses.retrieve(first.id) == first
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="And the moon?",
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    turns = [{"role": "user", "content": "Tell me about the sea."},
             {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And the moon?"}]
    assert second.output_text == _greedy(ref, tok, turns, 12)
    assert second.usage.input_tokens == len(tok.apply_chat_template(turns, tokenize=True))
    # A streamed continuation is kept once it has ended, as its last event gave it.
    events = client.responses.create(model="tiny", previous_response_id=second.id, input="Why?",
                                     max_output_tokens=8, temperature=0, stream=True)
    [third] = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    assert client.responses.retrieve(third.id) == third
    turns += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Why?"}]
    assert third.output_text == _greedy(ref, tok, turns, 8)
    assert all_free(aeng)


def test_store_false_deleted_and_unknown_responses_are_404s(served):
    url, client, aeng, _, _ = served
    kept = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0)
    unkept = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, store=False)
    assert unkept.store is False
    r = httpx.post(f"{url}/v1/responses/{kept.id}/cancel", timeout=30)     # nothing runs in the background
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    assert client.responses.delete(kept.id) is None
    for rid in (unkept.id, kept.id, "resp_nope"):
        for method, path in (("GET", f"/v1/responses/{rid}"), ("DELETE", f"/v1/responses/{rid}"),
                             ("POST", f"/v1/responses/{rid}/cancel")):
            r = httpx.request(method, url + path, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["param"] == "response_id", (method, path, r.text)
        r = httpx.post(url + "/v1/responses", timeout=30, json={"model": "tiny", "input": "x",
                                                                 "previous_response_id": rid})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert all_free(aeng)
