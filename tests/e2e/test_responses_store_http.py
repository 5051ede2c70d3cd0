"""The Responses API's stored responses over real HTTP, read by the `openai` client: a response is
kept unless `store: false`, GET returns it as it was answered (streamed ones too), a request naming
it in `previous_response_id` continues the whole conversation (its output equal to the engine's for
the chat the turns make, the earlier instructions not carried over), DELETE forgets it, and what
names an unknown or forgotten response is a 404 naming the field. A background response is answered
queued and polled to the engine's text; cancelling one aborts its request and frees its KV. A
response's input items list with ids, in pages either way. (The store's own order and capacity:
tests/unit/test_response_store.py; background tasks without an engine:
tests/unit/test_responses_background.py.)"""

from __future__ import annotations

import time

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


def _poll(client, rid, until, timeout=60.0):
    """The response once `until(response)` holds, polled for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.responses.retrieve(rid)
        if until(response):
            return response
        time.sleep(0.05)
    raise AssertionError(f"{rid}: still {response.status} after {timeout} s")


def test_a_background_response_is_polled_to_the_engines_text(served):
    url, client, aeng, ref, tok = served
    queued = client.responses.create(model="tiny", input="Tell me about the sea.", max_output_tokens=12,
                                     temperature=0, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _poll(client, queued.id, lambda r: r.status not in ("queued", "in_progress"))
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.output_text == _greedy(ref, tok, [{"role": "user", "content": "Tell me about the sea."}], 12)
    # Continued like any stored response.
    second = client.responses.create(model="tiny", previous_response_id=queued.id, input="And the moon?",
                                     max_output_tokens=6, temperature=0)
    turns = [{"role": "user", "content": "Tell me about the sea."},
             {"role": "assistant", "content": done.output_text}, {"role": "user", "content": "And the moon?"}]
    assert second.output_text == _greedy(ref, tok, turns, 6)
    r = httpx.post(f"{url}/v1/responses/{queued.id}/cancel", timeout=30)      # ended: returned as it is
    assert r.status_code == 200 and r.json()["status"] == done.status
    assert all_free(aeng)


def test_cancelling_a_background_response_aborts_its_request(served):
    url, client, aeng, _, _ = served
    queued = client.responses.create(model="tiny", input="Count.", max_output_tokens=3000, temperature=0,
                                     background=True, extra_body={"ignore_eos": True})
    _poll(client, queued.id, lambda r: r.status == "in_progress")
    r = httpx.delete(f"{url}/v1/responses/{queued.id}", timeout=30)        # running: cancel first
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert all_free(aeng, timeout=10)       # the request was aborted, its KV freed
    time.sleep(0.3)
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"        # again: the same
    assert client.responses.delete(queued.id) is None


def test_background_refusals_name_their_field(served):
    url, client, aeng, _, _ = served
    r = httpx.post(url + "/v1/responses", timeout=30, json={"model": "tiny", "input": "x", "background": True,
                                                             "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store", r.text
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0)
    for params, field in (({"stream": "true"}, "stream"), ({"stream": "true", "starting_after": "x"}, "stream")):
        r = httpx.get(f"{url}/v1/responses/{plain.id}", params=params, timeout=30)     # nothing streamed to resume
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert all_free(aeng)


def _events(lines) -> list[dict]:
    """The JSON events of an SSE stream's lines."""
    import json
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


def test_a_streamed_background_response_resumes_after_a_hang_up(served):
    """The POST streams the events as they come; a client that hangs up after a few leaves the
    response running, and resumes after the last sequence number it saw: the events join up
    with no gap or repeat, and the text is the engine's."""
    url, client, aeng, ref, tok = served
    body = {"model": "tiny", "input": "Tell me about the sea.", "max_output_tokens": 24, "temperature": 0,
            "background": True, "stream": True, "ignore_eos": True}
    seen = []
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        while len(seen) < 6:
            line = next(lines)
            if line.startswith("data: "):
                seen += _events([line])
    rid = seen[0]["response"]["id"]
    assert [e["sequence_number"] for e in seen] == list(range(6)) and seen[0]["type"] == "response.created"
    with httpx.stream("GET", f"{url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 5},
                      timeout=60) as r:
        rest = _events(r.iter_lines())
    assert [e["sequence_number"] for e in rest] == list(range(6, 6 + len(rest)))
    assert rest[-1]["type"] == "response.incomplete"          # max_output_tokens ran out
    text = "".join(e["delta"] for e in seen + rest if e["type"] == "response.output_text.delta")
    want = _greedy(ref, tok, [{"role": "user", "content": "Tell me about the sea."}], 24)
    assert text == want and client.responses.retrieve(rid).output_text == want
    # The whole stream again, from the store, once it has ended.
    with httpx.stream("GET", f"{url}/v1/responses/{rid}", params={"stream": "true"}, timeout=60) as r:
        assert _events(r.iter_lines()) == seen + rest
    assert all_free(aeng)



def test_input_items_list_the_conversation_in_pages(served):
    url, client, aeng, _, _ = served
    first = client.responses.create(model="tiny", input=[{"role": "user", "content": "One."},
                                                         {"role": "user", "content": "Two."}],
                                    max_output_tokens=3, temperature=0)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="Three.",
                                     max_output_tokens=3, temperature=0)
    page = client.responses.input_items.list(second.id, order="asc", limit=100)
    assert [i.type for i in page.data] == ["message", "message", "message", "message"]
    assert [i.content[0].text for i in page.data] == ["One.", "Two.", first.output_text, "Three."]
    assert page.data[2].id == first.output[0].id and all(i.id for i in page.data)
    assert not page.has_more and page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    ids = [i.id for i in page.data]
    # Newest first by default; the same ids on every listing.
    assert [i.id for i in client.responses.input_items.list(second.id).data] == ids[::-1]
    assert [i.id for i in client.responses.input_items.list(first.id, order="asc").data] == ids[:2]
    got = httpx.get(f"{url}/v1/responses/{second.id}/input_items",
                    params={"order": "asc", "limit": 2, "after": ids[0]}, timeout=30).json()
    assert [i["id"] for i in got["data"]] == ids[1:3] and got["has_more"] is True
    got = httpx.get(f"{url}/v1/responses/{second.id}/input_items",
                    params={"order": "asc", "limit": 2, "before": ids[3]}, timeout=30).json()
    assert [i["id"] for i in got["data"]] == ids[1:3] and got["has_more"] is True
    # The client's own pager walks every page.
    assert [i.id for i in client.responses.input_items.list(second.id, order="asc", limit=1)] == ids
    for params, field in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after"), ({"before": "msg_nope"}, "before")):
        r = httpx.get(f"{url}/v1/responses/{second.id}/input_items", params=params, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (params, r.text)
    r = httpx.get(f"{url}/v1/responses/resp_nope/input_items", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    assert all_free(aeng)


def test_cancelling_a_streamed_background_response_ends_its_streams(served):
    url, client, aeng, _, _ = served
    body = {"model": "tiny", "input": "Count.", "max_output_tokens": 3000, "temperature": 0, "background": True,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = _events([next(line for line in lines if line.startswith("data: "))])[0]
        rid = first["response"]["id"]
        assert client.responses.cancel(rid).status == "cancelled"
        rest = _events(lines)                   # the POST's own stream ends too
    assert all_free(aeng, timeout=10)
    with httpx.stream("GET", f"{url}/v1/responses/{rid}", params={"stream": "true"}, timeout=60) as r:
        stored = _events(r.iter_lines())
    assert stored[:1 + len(rest)] == [first] + rest and not any(e["type"] == "response.completed" for e in stored)
    assert client.responses.retrieve(rid).status == "cancelled"
