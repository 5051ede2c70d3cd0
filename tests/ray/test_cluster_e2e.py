"""The cluster over real HTTP on a local Ray cluster: mixed pools and prefill/decode pools with
KV moved by each connector give exactly the single-engine greedy output for 50 mixed requests,
streamed and not (for P/D: every decode-side pull succeeded, so the KV really moved and was not
recomputed), and the single engine's seeded sampled output, also while the pressure controller
moves instances between the prefill pools; the openai client works; streams, greedy and seeded,
survive a router restart (killed mid-stream, Ray restarts it, the gateway resubmits, the text is
still the single engine's) and an engine replica killed mid-stream (its requests resume
elsewhere); afterwards every instance's KV is free and the router's in-flight table is empty."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import httpx
import pytest
from cluster_http import complete
from serve_app import free_port

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

BASE = {"model": "tiny", "policy": "lars", "threads_per_instance": 1, "max_local_waiting": 4,
        "engine": {"kv_cache_tokens": 16384}, "tool_call_parser": "hermes", "allow_runtime_lora_updating": True}
PD_POOLS = [{"role": "prefill-short", "instances": 1, "engine": {"packer": "awd"}},
            {"role": "prefill-long", "instances": 1},
            {"role": "decode", "instances": 1,
             "engine": {"policy": "fcfs", "packer": "token", "decode_selector": "kairos",
                        # Drafts on every P/D decode instance: each exact comparison also checks
                        # that speculative decoding changes no token (greedy or seeded).
                        "speculative_method": "ngram"}}]
CACHING = {"engine": {**BASE["engine"], "enable_prefix_caching": True}}
TOPOLOGIES = {
    # Prefix caching on here and in pd-object_store: every exact comparison also checks that
    # cached prefixes change no token.
    "mixed": {"pools": [{"role": "mixed", "instances": 2}], **CACHING},
    # One Medha KVP instance: the replica leads, its second rank is a Ray actor (token packer:
    # no profiling run for the group's own predictor).
    "mixed-kvp": {"pools": [{"role": "mixed", "instances": 1, "engine": {
        "kvp": 2, "group_launch": "ray", "packer": "token", "predictor": "none"}}]},
    "pd-object_store": {"connector": "object_store", "initial_l_m": 256, "pools": PD_POOLS, **CACHING},
    "pd-nixl": {"connector": "nixl", "initial_l_m": 256, "pools": PD_POOLS},
    # Its short prompts prefill on a TP group (EAGLE_TOPOLOGIES: the head drafts on its leader).
    "pd-torch_dist": {"connector": "torch_dist", "initial_l_m": 256, "pools": [
        {**PD_POOLS[0], "engine": {**PD_POOLS[0]["engine"], "tp": 2, "group_launch": "ray"}}, *PD_POOLS[1:]]},
    # Groups in P/D: short prompts prefill on a TP group, long ones on an SPP group, decodes run
    # on a KVP group; KV leaves the TP / SPP ranks and reaches the KVP ranks through each group's
    # staging port. The KVP group's leader drafts with a draft model (the tiny checkpoint itself).
    "pd-groups": {"connector": "object_store", "initial_l_m": 256, "pools": [
        {**PD_POOLS[0], "engine": {**PD_POOLS[0]["engine"], "tp": 2, "group_launch": "ray"}},
        {**PD_POOLS[1], "engine": {"spp": 2, "spp_micro_tokens": 128, "group_launch": "ray"}},
        {**PD_POOLS[2], "engine": {**PD_POOLS[2]["engine"], "kvp": 2, "group_launch": "ray",
                                   "speculative_method": "draft_model", "speculative_model": "tiny"}}]},
    # The pressure controller on: instances change pools while the requests run.
    "pd-controller": {"connector": "object_store", "initial_l_m": 256,
                      "controller": {"enabled": True, "period_s": 0.5, "cooldown_s": 2.0},
                      "pools": [PD_POOLS[0], {**PD_POOLS[1], "instances": 2}, PD_POOLS[2]]},
}



@pytest.fixture(scope="module")
def serve_port(ray_cluster):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


@pytest.fixture(scope="module")
def workload(tiny_model_dir):
    """50 requests: prompts as text and as token ids, 3 to 900 tokens, 1 to 12 output tokens."""
    rng = random.Random(3)
    words = ["the", "river", "stone", "light", "over", "a", "quiet", "town", "and", "wind"]
    out = []
    for i in range(50):
        n = rng.choice([3, 9, 30, 80, 200, 300, 500, 900])
        prompt = " ".join(rng.choice(words) for _ in range(n)) if i % 2 else \
            [rng.randrange(6, 4000) for _ in range(n)]
        out.append((prompt, rng.randint(1, 12)))
    return out


@pytest.fixture(scope="module")
def expected(tiny_model_dir, workload):
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    model, mcfg = load_model(tiny_model_dir)
    tok = Tokenizer(tiny_model_dir, mcfg.eos_token_id)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=32768), model, tok)
    ids = [tok.encode(p) if isinstance(p, str) else p for p, _ in workload]
    outs = eng.generate(ids, [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in workload])
    return [tok.decode(o) for o in outs]


SEEDED = {"temperature": 0.9, "top_p": 0.95}       # sampled requests (each with its own seed)


def _single_engine_texts(tiny_model_dir, prompts: list, max_tokens: int, params: list[dict]) -> list[str]:
    """The single engine's text for each prompt under its sampling fields (greedy by default)."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    model, mcfg = load_model(tiny_model_dir)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=32768), model)
    outs = eng.generate(prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **p) for p in params])
    tok = Tokenizer(tiny_model_dir, mcfg.eos_token_id)
    return [tok.decode(o) for o in outs]


@pytest.fixture(scope="module")
def prefix_workload(tiny_model_dir):
    """A 320-token system prompt (20 blocks of 16) and 5 prompts that continue it with 8-40
    tokens of their own, and their single-engine greedy text."""
    rng = random.Random(11)
    system = [rng.randrange(6, 4000) for _ in range(320)]
    prompts = [system + [rng.randrange(6, 4000) for _ in range(rng.randrange(8, 40))] for _ in range(5)]
    return prompts, _single_engine_texts(tiny_model_dir, prompts, 6, [{}] * len(prompts))


@pytest.fixture(scope="module")
def restart_workload(tiny_model_dir):
    """12 streams long enough to be cut mid-way (token-id prompts, 48 tokens each; odd ones
    sampled with seed 100 + i, even ones greedy), their sampling fields and their single-engine
    text: a stream resumed elsewhere must go on drawing its seeded tokens as if never cut."""
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 4000) for _ in range(rng.choice([20, 60, 150, 400]))] for _ in range(12)]
    params = [{} if i % 2 == 0 else {**SEEDED, "seed": 100 + i} for i in range(12)]
    return prompts, params, _single_engine_texts(tiny_model_dir, prompts, 48, params)


# Topologies that also serve a LoRA adapter (written at run time): two cache prefixes, so the
# adapter's blocks must stay apart from the base's; in P/D its KV moves to the decode side; in
# the group topologies every rank (a Ray actor) serves its shard of it.
LORA_TOPOLOGIES = ("mixed", "pd-object_store", "mixed-kvp", "pd-groups")
# Every pool drafts with an EAGLE head (its KV is an extra layer of each instance's; on the TP
# prefill group, a tensor of the leader's): the handoffs move that layer with the prompt's KV,
# and a pool without it could not pull them.
EAGLE_TOPOLOGIES = ("pd-torch_dist",)


@pytest.fixture(scope="module")
def lora_adapter(tiny_model_dir, tmp_path_factory, merged_lora):
    """(adapter dir, the base model with the adapter merged into its weights: the reference)."""
    from raycluster.model.tiny import write_tiny_lora

    path = write_tiny_lora(tmp_path_factory.mktemp("lora") / "sql", tiny_model_dir, seed=1)
    return path, merged_lora(path)


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def cluster(request, serve_port, lora_adapter, eagle_heads):
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.launcher import wait_healthy

    if request.param == "pd-nixl":
        pytest.importorskip("nixl")
    cfg = {**BASE, **TOPOLOGIES[request.param], "router_name": f"router-{request.param}"}
    if request.param in LORA_TOPOLOGIES:
        cfg["engine"] = {**cfg["engine"], "lora_modules": [f"sql={lora_adapter[0]}"]}
        cfg["lora_resolver_dir"] = os.path.dirname(lora_adapter[0])     # adapters load on first use from here
    if request.param in EAGLE_TOPOLOGIES:
        cfg["pools"] = [{**p, "engine": {**p.get("engine", {}), "speculative_method": "eagle",
                                         "speculative_model": eagle_heads["trained"], "num_speculative_tokens": 3}}
                        for p in cfg["pools"]]
    serve.run(build_app(cfg), name="raycluster", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{serve_port}"
    if not wait_healthy(url + "/health", 300):
        pytest.fail(f"{request.param}: cluster not healthy within 300 s")
    yield url, request.param
    serve.delete("raycluster")
    ray.kill(ray.get_actor(cfg["router_name"], namespace="raycluster"))


def _assert_drained(url: str, timeout: float = 20.0) -> None:
    """Every instance's KV free (nothing parked or leaked) and no request in flight."""
    deadline = time.monotonic() + timeout
    status = {}
    while time.monotonic() < deadline:
        status = httpx.get(url + "/v1/cluster/status", timeout=5).json()
        if status["inflight"] == 0 and status["instances"] and all(
                i["kv_free_blocks"] == i["kv_total_blocks"] and i["waiting"] == 0 and i["running"] == 0
                for i in status["instances"]):
            return
        time.sleep(0.3)
    where = json.dumps(_placements(), default=str)[:2000]
    pytest.fail(f"cluster did not drain: {json.dumps(status)[:2000]}; where the requests are: {where}")


def _placements() -> dict:
    """Every router actor's request placements (queue or instance, mode, parked KV), to say
    where a request that did not drain is stuck."""
    import ray

    found = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("router"):
            try:
                found[a["name"]] = ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).placements.remote(),
                                           timeout=10)
            except Exception as e:  # noqa: BLE001 -- a diagnostic on the failure path only
                found[a["name"]] = repr(e)
    return found


@pytest.mark.parametrize("stream", [False, True])
def test_fifty_mixed_requests_equal_single_engine(cluster, workload, expected, stream):
    url, name = cluster

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(complete(client, url, p, m, stream) for p, m in workload))

    got = asyncio.run(run())
    bad = [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not bad, (name, bad[:5], len(bad))
    _assert_drained(url)
    if name.startswith("pd-"):
        # The text would match even if every handoff fell back to recomputing: check that the
        # KV really moved through the connector.
        from ray import serve
        dec = serve.get_deployment_handle("pool-decode", app_name="raycluster")
        pulls = dec.kv_state.remote().result(timeout_s=30)["kv_pulls"]
        assert pulls["ok"] >= 10 and pulls["failed"] == 0, (name, pulls)
        # ... and the same counts reach the router's status (and so /metrics) with the heartbeats.
        deadline, seen = time.monotonic() + 10, None
        while time.monotonic() < deadline:
            seen = [(i["kv_pulls_ok"], i["kv_pulls_failed"]) for i in
                    httpx.get(url + "/v1/cluster/status", timeout=5).json()["instances"] if i["role"] == "decode"]
            if seen == [(pulls["ok"], 0)]:
                break
            time.sleep(0.2)
        assert seen == [(pulls["ok"], 0)], (name, seen, pulls)
        assert f'outcome="ok"}} {pulls["ok"]}' in httpx.get(url + "/metrics", timeout=5).text


def test_echo_with_logprobs_reports_the_prompts_logprobs(cluster, tiny_model_dir):
    """lm-eval's loglikelihood request (echo + logprobs) on every topology: the prompt's token
    log-probabilities equal a single engine's (in P/D the prefill instance computes them and they
    travel with the first token; a 350-token prompt takes the long pool, an SPP group in
    pd-groups), also when the prompt is cached already (a request asking for them computes every
    position)."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.request import SamplingParams

    url, name = cluster
    rng = random.Random(23)         # its own prompt: blocks it leaves cached must not serve other tests
    prompt = [rng.randrange(6, 4000) for _ in range(350)]
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096), load_model(tiny_model_dir)[0])
    eng.add_request("r", prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1, logprobs=1))
    want, gen = None, []
    for _ in range(100):
        if not eng.has_unfinished():
            break
        for o in eng.step().outputs:
            want = o.prompt_logprobs or want
            gen += [e.logprob for e in o.logprobs]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 1}
    for attempt in range(2):        # the second time its blocks are cached where caching is on
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 3 and lp["token_logprobs"][0] is None, (name, attempt)
        assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in want[1:]] + gen, abs=2e-4), (name, attempt)
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        # vLLM's `prompt_logprobs` too: each prompt token's rank travels with it (P/D: PrefillDone).
        # Tokens within fp32 noise of one another may swap places between engines: near, mostly equal.
        plp = r.json()["choices"][0]["prompt_logprobs"]
        ranks = [(d[str(t)]["rank"], e.rank) for t, d, e in zip(prompt[1:], plp[1:], want[1:])]
        assert plp[0] is None and len(ranks) == len(prompt) - 1 and all(abs(a - b) <= 3 for a, b in ranks)
        assert sum(a == b for a, b in ranks) >= 0.9 * len(ranks), (name, attempt)
    _assert_drained(url)


def test_structured_outputs_follow_the_request_across_instances(cluster, tiny_model_dir):
    """A JSON schema on every topology, streamed and not: in P/D the prefill instance samples
    the first token under the pattern and the decode instance replays it into its own guide
    (a 350-token prompt takes the long pool, an SPP group in pd-groups); the text equals a single
    engine's and is valid JSON. So does a grammar's. A forced tool call's arguments are the same
    pattern's text."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams
    from raycluster.server.structured import escape, schema_regex

    url, name = cluster
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                               "n": {"enum": [1, 2, 3]}, "flag": {"type": "boolean"}},
              "required": ["word", "n", "flag"]}
    tok = Tokenizer(tiny_model_dir)
    rng = random.Random(41)
    prompts = [[rng.randrange(6, 4000) for _ in range(k)] for k in (12, 350)]
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=4096), load_model(tiny_model_dir)[0], tok)
    want = [tok.decode(o) for o in eng.generate(prompts, SamplingParams(max_tokens=80, guided_regex=schema_regex(schema, "f")))]
    for p, w in zip(prompts, want):
        body = {"prompt": p, "max_tokens": 80, "temperature": 0, "guided_json": schema}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == w, (name, len(p))
        parts = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
        assert "".join(parts) == w, (name, len(p))
    assert all(isinstance(json.loads(w), dict) for w in want)
    # A context-free grammar (llguidance) crosses instances the same way: the decode side
    # replays the first token into its own parser.
    grammar = 'start: "(" start ")" | "x" | "[" start "]"'
    want = [tok.decode(o) for o in eng.generate(prompts, SamplingParams(max_tokens=40, guided_grammar=grammar))]
    for p, w in zip(prompts, want):
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "prompt": p, "max_tokens": 40, "temperature": 0, "structured_outputs": {"grammar": grammar}})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == w, (name, len(p), r.text)
    # A forced tool call rides on the same pattern: its arguments are that text.
    chat = [{"role": "user", "content": "call it"}]
    ids = tok.apply_chat_template(chat, tokenize=True)
    [args] = [tok.decode(o) for o in eng.generate([ids], SamplingParams(max_tokens=80, guided_regex=schema_regex(schema, "f")))]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": chat, "max_tokens": 80, "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "f"}},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": args}
    # tool_choice "auto" with the cluster's parser (hermes): a call in the model's syntax is read.
    regex = escape('<tool_call>{"name": "f", "arguments": {"n": ') + "[1-3]" + escape("}}</tool_call>")
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": chat, "max_tokens": 150, "temperature": 0, "guided_regex": regex,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"] or [r.json()["choices"][0]]     # (shows the text)
    assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"])["n"] in (1, 2, 3)
    _assert_drained(url)


def test_seeded_sampling_equals_single_engine(cluster, tiny_model_dir):
    """Sampled requests with a seed give the single engine's text on every topology: token k is
    drawn from (seed, k), so in P/D the decode instance goes on with the draws the prefill
    instance started (the 300- and 600-token prompts take the long pool, an SPP group in
    pd-groups; decodes run on a KVP group there)."""
    url, name = cluster
    rng = random.Random(31)         # its own prompts
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (5, 40, 120, 300, 600, 30)]
    params = [{**SEEDED, "top_k": 50, "seed": 200 + i} for i in range(len(prompts))]
    want = _single_engine_texts(tiny_model_dir, prompts, 10, params)
    assert len(set(want)) == len(want)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": prompts[i], "max_tokens": 10, "ignore_eos": True, **params[i]}
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    assert asyncio.run(run()) == want, name
    _assert_drained(url)


def test_embeddings_and_scores_equal_the_single_engines(cluster, tiny_model_dir):
    """/v1/embeddings and /v1/score through the router: each input a prefill-only request on a
    prefill (or mixed) instance, TP and KVP groups included, its vector the single engine's (raw
    there, normalised by the gateway), a score the cosine of two of them."""
    import torch
    import torch.nn.functional as F

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    url, _ = cluster
    rng = random.Random(8)
    prompts = [[rng.randrange(6, 4000) for _ in range(n)] for n in (2, 30, 120, 200)]     # short: below l_m
    r = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "input": prompts}, timeout=120)
    assert r.status_code == 200, r.text
    texts = ["hello river", "the sea", "hello river and the sea"]
    score = httpx.post(url + "/v1/score", json={"text_1": texts[0], "text_2": texts[1:]}, timeout=120)
    assert score.status_code == 200, score.text
    model, mcfg = load_model(tiny_model_dir)
    tok = Tokenizer(tiny_model_dir, mcfg.eos_token_id)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=8192), model)
    reqs = [eng.add_request(f"e{i}", p, SamplingParams(max_tokens=1, embed=True))
            for i, p in enumerate(prompts + [tok.encode(t) for t in texts])]
    while eng.has_unfinished():
        eng.step()
    vectors = [F.normalize(torch.tensor(req.embedding), dim=0) for req in reqs]
    for d, want in zip(r.json()["data"], vectors):
        assert max(abs(a - b) for a, b in zip(d["embedding"], want.tolist())) < 1e-5
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, prompts))
    q, *docs = vectors[len(prompts):]
    assert [d["score"] for d in score.json()["data"]] == pytest.approx([float(q @ v) for v in docs], abs=1e-5)
    _assert_drained(url)


def test_openai_client_and_status(cluster):
    openai = pytest.importorskip("openai")
    url, name = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    out = client.completions.create(model="tiny", prompt="hello river", max_tokens=5, temperature=0, logprobs=2)
    assert out.usage.completion_tokens <= 5
    # Logprobs travel with the tokens (in P/D the first one from the prefill instance): greedy
    # picks the most likely token each time.
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(v == pytest.approx(max(top.values())) for v, top in zip(lp.token_logprobs, lp.top_logprobs))
    # Penalties travel with the request: a negative frequency penalty makes this tiny model repeat
    # its first token (a plain greedy run does not).
    body = {"prompt": [7, 300, 9, 11], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    toks = [httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60).json()["choices"][0]
            ["logprobs"]["tokens"] for extra in ({}, {"frequency_penalty": -2.0})]
    assert len(set(toks[0])) > 1 and len(set(toks[1])) == 1, toks
    two = client.completions.create(model="tiny", prompt="hello river", max_tokens=5, temperature=0, n=2)
    assert [c.text for c in two.choices] == [out.choices[0].text] * 2      # greedy: both the same
    batch = client.completions.create(model="tiny", prompt=["the sea", "hello river"], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == out.choices[0].text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and len(chunks) >= 2
    # The Responses API rides the chat route through the gateway: the same text, streamed or not.
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    resp = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0)
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, stream=True))
    assert resp.output_text == chat.choices[0].message.content == events[-1].response.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    # Stored in the router for every gateway replica: fetched back, and continued.
    assert client.responses.retrieve(resp.id) == resp and client.responses.retrieve(events[-1].response.id)
    more = client.responses.create(model="tiny", previous_response_id=resp.id, input="and?", max_output_tokens=4,
                                   temperature=0)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": resp.output_text},
             {"role": "user", "content": "and?"}]
    again = client.chat.completions.create(model="tiny", messages=turns, max_tokens=4, temperature=0)
    assert more.output_text == again.choices[0].message.content
    # Background responses run in the gateway replica and are polled through the router's store;
    # a cancelled one ends cancelled and its request is aborted (checked drained below).
    bg = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, background=True)
    deadline = time.monotonic() + 60
    while bg.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        bg = client.responses.retrieve(bg.id)
    assert bg.status == resp.status and bg.output_text == resp.output_text
    long = client.responses.create(model="tiny", input="count", max_output_tokens=200, temperature=0,
                                   background=True, extra_body={"ignore_eos": True})
    assert client.responses.cancel(long.id).status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    # Streamed in the background: its events reach the router's store, where a stream resumes.
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0, "background": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as r:
        live = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    rid = live[0]["response"]["id"]
    assert "".join(e["delta"] for e in live if e["type"] == "response.output_text.delta") == resp.output_text
    deadline = time.monotonic() + 30
    while client.responses.retrieve(rid).status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.05)
    with httpx.stream("GET", f"{url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 1},
                      timeout=60) as r:
        assert [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")] == live[2:]
    assert httpx.get(url + "/v1/cluster/status", timeout=5).json()["stored_responses"] >= 6
    metrics = httpx.get(url + "/metrics").text
    assert "raycluster_ttft_seconds_bucket" in metrics and "raycluster_instance_kv_usage" in metrics
    assert "raycluster_instance_prefill_backlog_tokens{" in metrics
    assert 'vllm:num_requests_waiting{model_name="tiny"}' in metrics and "vllm:time_to_first_token_seconds" in metrics
    # The instances' prefill times reach the gateway (through the P/D handoff too).
    assert re.search(r'vllm:request_prefill_time_seconds_count\{model_name="tiny"\} [1-9]', metrics)
    bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    instances = httpx.get(url + "/v1/cluster/status", timeout=5).json()["instances"]
    if name.startswith("pd-"):      # their decode instances draft (speculative decoding)
        drafted = sum(i["spec_draft_tokens"] for i in instances if i["role"] == "decode")
        assert drafted > 0 and "raycluster_instance_spec_decode_draft_tokens_total" in metrics
        if name in EAGLE_TOPOLOGIES:
            assert sum(i["spec_accepted_tokens"] for i in instances if i["role"] == "decode") > 0
    layouts = {i["layout"] for i in instances}
    assert layouts == {"mixed-kvp": {"kvp2"}, "pd-groups": {"tp2", "spp2", "kvp2"},
                       "pd-torch_dist": {"tp2", "single"}}.get(name, {"single"})
    tok = httpx.post(url + "/tokenize", json={"prompt": "hello river"}, timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > tok["count"]
    _assert_drained(url)


def test_a_lora_adapter_runs_wherever_its_request_goes(cluster, lora_adapter, tiny_model_dir):
    """A request naming the adapter gets the merged model's text (through the P/D handoff too),
    the base name the base's, on the same prompts; the gateway lists the adapter."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    url, name = cluster
    tok = Tokenizer(tiny_model_dir, (1,))
    if name not in LORA_TOPOLOGIES:
        pytest.skip("this topology serves no adapter")
    cfg = EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=8192)
    refs = {"sql": LLMEngine(cfg, lora_adapter[1]), "tiny": LLMEngine(cfg, load_model(tiny_model_dir)[0])}
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert ("sql", "tiny") in [(m["id"], m.get("parent")) for m in models]
    for i, n in enumerate((20, 300, 700)):      # in P/D: prefill-short, prefill-long, then decode
        prompt = list(range(40 + i, 40 + i + n))
        for model, ref in refs.items():
            want = tok.decode(ref.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0])
            body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want, (model, n)
    _assert_drained(url)


def test_adapters_load_and_unload_on_every_instance_at_run_time(cluster, tiny_model_dir, tmp_path, merged_lora,
                                                                lora_adapter):
    """vLLM's /v1/load_lora_adapter through the gateway: every instance loads it before the
    answer (the router's status lists it on each), requests on it get the merged model's text
    wherever they run (P/D handoffs too), a path with no adapter is a 404 and no instance keeps
    anything of it, and after /v1/unload_lora_adapter the name is a 404 model and every instance
    has dropped it. An adapter put in the resolver directory is served on first use."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.tiny import write_tiny_lora
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    url, name = cluster
    if name not in LORA_TOPOLOGIES:
        pytest.skip("this topology serves no adapter")
    path = write_tiny_lora(tmp_path / "rt", tiny_model_dir, seed=5)
    ref = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=8192), merged_lora(path))
    tok = Tokenizer(tiny_model_dir, (1,))

    def adapters_per_instance():
        return [sorted(i["lora_adapters"]) for i in httpx.get(url + "/v1/cluster/status", timeout=10).json()["instances"]]

    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(tmp_path / "nowhere")},
                   timeout=120)
    assert r.status_code == 404 and "no adapter found" in r.json()["error"]["message"]
    assert all(a == ["sql"] for a in adapters_per_instance())
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(path)}, timeout=120)
    assert r.status_code == 200, r.text
    assert all(a == ["rt", "sql"] for a in adapters_per_instance())
    assert ("rt", "tiny") in [(m["id"], m.get("parent")) for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    for i, n in enumerate((20, 300, 700)):      # in P/D: prefill-short, prefill-long, then decode
        prompt = list(range(60 + i, 60 + i + n))
        want = tok.decode(ref.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0])
        body = {"model": "rt", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (n, r.text)
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "rt"}, timeout=30).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"model": "rt", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 404
    # The resolver directory (the static adapter's parent): a new adapter there is served on its
    # first request, loaded on every instance first; then unloaded like any other.
    found = write_tiny_lora(os.path.join(os.path.dirname(lora_adapter[0]), "found"), tiny_model_dir, seed=6)
    want = tok.decode(LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=8192), merged_lora(found))
                      .generate([list(range(80, 380))], SamplingParams(max_tokens=10, ignore_eos=True))[0])
    body = {"model": "found", "prompt": list(range(80, 380)), "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    assert all(a == ["found", "sql"] for a in adapters_per_instance())
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "found"}, timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while any(a != ["sql"] for a in adapters_per_instance()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(a == ["sql"] for a in adapters_per_instance())
    _assert_drained(url)


def test_client_disconnect_aborts_everywhere(cluster):
    url, _ = cluster
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": [9] * 400, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    _assert_drained(url)


def test_controller_moves_a_long_instance_when_short_prompts_pile_up(cluster, workload, expected):
    url, name = cluster
    if name != "pd-controller":
        pytest.skip("the controller runs in the pd-controller topology only")
    shorts = [(i, p) for i, (p, _) in enumerate(workload) if isinstance(p, list) and len(p) < 256]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(complete(client, url, p, workload[i][1], False) for i, p in shorts * 3))

    got = asyncio.run(run())
    assert got == [expected[i] for i, _ in shorts * 3]
    status = httpx.get(url + "/v1/cluster/status", timeout=5).json()
    # Earlier tests on this cluster sent bursts too, so the move may predate this one; at least
    # one long instance went to the short pool, and min_per_pool kept one in each prefill pool.
    moves = status["controller"]["moves"]
    assert any(m["from"] == "prefill-long" and m["to"] == "prefill-short" for m in moves), moves
    roles = sorted(i["role"] for i in status["instances"])
    assert roles.count("decode") == 1 and len(roles) == 4, roles
    assert "prefill-long" in roles and "prefill-short" in roles, roles
    _assert_drained(url)


def _streams_cut_by(url: str, prompts: list, params: list[dict], kill,
                    max_tokens: int = 48) -> tuple[list[str], object]:
    """Streams of `prompts` (greedy unless `params[i]` says otherwise); once 40 SSE events (about
    a token each) have come and some stream is still running, `kill()` runs; returns every
    stream's text and what `kill` returned."""
    got: list[list[str]] = [[] for _ in prompts]

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, **params[i]}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:])["choices"]:
                        got[i].append(c["text"])

    async def run():
        async with httpx.AsyncClient(timeout=240) as client:
            tasks = [asyncio.create_task(stream(client, i)) for i in range(len(prompts))]
            deadline = time.monotonic() + 120
            while sum(map(len, got)) < 40 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not all(t.done() for t in tasks), "all finished before the kill"
            killed = kill()
            await asyncio.gather(*tasks)
            return killed

    killed = asyncio.run(run())
    return ["".join(g) for g in got], killed


def test_router_restart_resumes_every_stream(cluster, restart_workload):
    url, name = cluster
    if name not in ("mixed", "pd-object_store"):
        pytest.skip("one mixed and one P/D topology")
    import ray

    prompts, params, expected = restart_workload
    texts, _ = _streams_cut_by(url, prompts, params, lambda: ray.kill(ray.get_actor(f"router-{name}", namespace="raycluster"),
                                                               no_restart=False))
    assert texts == expected
    assert httpx.get(url + "/health", timeout=30).json()["resubmitted"] > 0
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert any(line.startswith("raycluster_gateway_resubmitted_total ") and float(line.split()[1]) > 0
               for line in metrics.splitlines())
    _assert_drained(url, timeout=60)


def test_a_shared_prefix_is_computed_once(cluster, prefix_workload):
    """One request computes the system prompt; four sent together after it find it cached (the
    router sends them where it is: four fit the instance's max_local_waiting, a fifth would go to
    the other instance), and the text is the single engine's."""
    url, name = cluster
    if "enable_prefix_caching" not in TOPOLOGIES[name].get("engine", {}):
        pytest.skip("prefix caching is on in the mixed and pd-object_store topologies")
    prompts, expected = prefix_workload

    async def one(client: httpx.AsyncClient, prompt) -> tuple[str, int]:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            first = await one(client, prompts[0])
            return [first, *await asyncio.gather(*(one(client, p) for p in prompts[1:]))]

    got = asyncio.run(run())
    assert [t for t, _ in got] == expected
    assert [c for _, c in got] == [0] + [320] * 4, name
    status = httpx.get(url + "/v1/cluster/status", timeout=5).json()
    assert sum(i["prefix_hit_tokens"] for i in status["instances"] if i["role"] != "decode") >= 4 * 320
    if any(i["role"] == "decode" for i in status["instances"]):
        # The decode pool kept the first handoff's KV findable: the other four pulled only
        # the blocks after the system prompt.
        assert sum(i["prefix_hit_tokens"] for i in status["instances"] if i["role"] == "decode") >= 4 * 320
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert "raycluster_instance_prefix_cache_hits_total{" in metrics
    _assert_drained(url)


def test_a_killed_instance_resumes_its_streams_elsewhere(cluster, restart_workload):
    """An engine replica killed mid-stream (its process gone, no goodbye to the router): the
    router misses its heartbeats, re-queues its requests from prompt plus the tokens already
    delivered, they finish elsewhere (on the other mixed instance; on P/D, prefilled again and
    decoded on Serve's replacement) with the single engine's text, and the replacement joins."""
    url, name = cluster
    if name not in ("mixed", "pd-object_store"):
        pytest.skip("one mixed and one P/D topology")
    import ray

    prompts, params, expected = restart_workload
    role = "mixed" if name == "mixed" else "decode"
    # Every instance of the topology registered (after an earlier test's restart one may still be
    # re-registering: a CI run once took the status without its decode instance).
    want = sum(p["instances"] for p in TOPOLOGIES[name]["pools"])
    deadline = time.monotonic() + 60
    while True:
        before = {i["id"] for i in httpx.get(url + "/v1/cluster/status", timeout=10).json()["instances"]}
        if len(before) >= want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(before) == want, before

    def kill_the_busiest() -> str:
        # An instance of the role running requests (bounded wait: the streams have just started).
        deadline = time.monotonic() + 30
        while True:
            status = httpx.get(url + "/v1/cluster/status", timeout=10).json()
            busy = [i for i in status["instances"] if i["role"] == role and i["running"] > 0]
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert busy, status
        victim = max(busy, key=lambda i: i["running"])
        # A Serve replica's actor is SERVE_REPLICA::APP#DEPLOYMENT#ID; the instance id ends in ID.
        actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].endswith("#" + victim["id"].rsplit("-", 1)[1]))
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        return victim["id"]

    texts, killed = _streams_cut_by(url, prompts, params, kill_the_busiest)
    assert texts == expected
    _assert_drained(url, timeout=90)
    deadline = time.monotonic() + 120        # Serve's replacement registers with the router
    while time.monotonic() < deadline:
        ids = {i["id"] for i in httpx.get(url + "/v1/cluster/status", timeout=10).json()["instances"]}
        if killed not in ids and len(ids) == len(before):
            break
        time.sleep(0.5)
    assert killed not in ids and len(ids) == len(before), (before, ids)
