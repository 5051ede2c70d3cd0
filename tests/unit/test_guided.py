"""Structured outputs in the engine: every finished output matches its pattern (a JSON schema, a
choice list, a regex, a context-free grammar in Lark or GBNF), greedy or sampled, on a model with
random weights; a request resumed elsewhere with tokens it already has (a P/D handoff) continues
in the same state; the request fields become the pattern with errors naming the field; token
bytes are exact."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import InvalidRequestError, LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams
from raycluster.server.protocol import ChatCompletionRequest, CompletionRequest
from raycluster.engine.guided import Grammar, Regex
from raycluster.server.structured import choice_regex, json_object_regex, pattern_of, schema_regex

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "pets", "ok"]}
COLOURS = ["red", "green", "light blue (sky)"]
CODE = r"[A-Z]{3}-[0-9]{2,4}"
# Balanced parentheses around one x: a context-free language no regular expression holds.
PARENS = 'start: "(" start ")" | "x"'
PARENS_GBNF = 'root ::= "(" root ")" | "x"'


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _engine(model, tok, **kw) -> LLMEngine:
    cfg = {"policy": "fcfs", "packer": "token", "kv_cache_tokens": 8192, "chunk_size": 32, "num_threads": 1, **kw}
    return LLMEngine(EngineConfig(**cfg), model, tokenizer=tok)


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in ("Tell me about a person:", "Pick a colour", "The code is", "{")]


def _check(text: str, kind: str) -> None:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "choice":
        assert text in COLOURS
    else:
        assert re.fullmatch(CODE, text), text


def test_every_output_matches_its_pattern_greedy_and_sampled(model, tok):
    eng = _engine(model, tok)
    kinds = ["schema", "choice", "regex", "schema"]
    pats = {"schema": schema_regex(SCHEMA, "f"), "choice": choice_regex(COLOURS, "f"), "regex": CODE}
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (0.8, 3)):
        params = [SamplingParams(max_tokens=200, temperature=temperature, seed=seed, guided_regex=pats[k])
                  for k in kinds]
        reqs = [eng.add_request(f"g{temperature}-{seed}-{i}", p, sp)
                for i, (p, sp) in enumerate(zip(_prompts(tok), params))]
        for _ in range(2000):
            if not eng.has_unfinished():
                break
            eng.step()
        for r, kind in zip(reqs, kinds):
            assert r.output_token_ids[-1] in eng.eos_token_ids, (kind, tok.decode(r.output_token_ids))
            _check(tok.decode(r.output_token_ids), kind)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng._guided._guides


def test_unguided_output_does_not_match(model, tok):
    """The test above is not vacuous: the same model, unconstrained, writes no such JSON."""
    out = _engine(model, tok).generate(_prompts(tok)[:1], SamplingParams(max_tokens=60))[0]
    with pytest.raises(ValueError):
        json.loads(tok.decode(out))


def _resumed(model, tok, prompt: list[int], sp: SamplingParams, had: list[int]) -> list[int]:
    """The output of a request resumed on a fresh engine with the tokens it `had`."""
    dec = _engine(model, tok)
    r = dec.add_request("d", prompt, sp, output_token_ids=had)
    for _ in range(500):
        if not dec.has_unfinished():
            break
        dec.step()
    return r.output_token_ids


def test_a_resumed_request_continues_its_pattern_exactly(model, tok):
    """A P/D handoff: the prefill side samples the first token, the decode side gets the
    request with that token and replays it into a fresh guide; the whole output equals one
    engine's (greedy), token for token."""
    sp = SamplingParams(max_tokens=120, guided_regex=schema_regex(SCHEMA, "f"))
    prompt = _prompts(tok)[0]
    whole = _engine(model, tok).generate([prompt], sp)[0]
    pre = _engine(model, tok)
    pre.add_request("p", prompt, sp, prefill_only=True)
    (first,) = [t for o in pre.step().outputs for t in o.new_token_ids]
    assert first == whole[0] and not pre._guided._guides          # forgotten when it finished
    for cut in (1, 7):      # also a request resumed mid-output (a router restart)
        assert _resumed(model, tok, prompt, sp, whole[:cut]) == whole
    _check(tok.decode(whole), "schema")


def test_min_tokens_beyond_the_pattern_still_ends_at_eos(model, tok):
    """The choice is complete after 1-5 tokens, min_tokens bans EOS for 20: the pattern wins
    (no row left without a token to sample)."""
    eng = _engine(model, tok)
    out = eng.generate(_prompts(tok)[1:2], SamplingParams(max_tokens=40, min_tokens=20,
                                                          guided_regex=choice_regex(COLOURS, "f")))[0]
    assert out[-1] in eng.eos_token_ids and tok.decode(out) in COLOURS


def test_engine_refuses_what_it_cannot_enforce(model, tok):
    eng = _engine(model, tok)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("a", [5, 6], SamplingParams(guided_regex="(unclosed"))
    assert e.value.field == "guided_regex"
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("b", [5, 6], SamplingParams(guided_regex="x" * 40000))
    assert e.value.field == "guided_regex"
    assert not eng.has_unfinished()


def test_ignore_eos_runs_on_with_eos_once_the_pattern_is_complete(model, tok):
    """vLLM's benchmarking switch: the output is the pattern's text, then EOS to max_tokens."""
    eng = _engine(model, tok)
    out = eng.generate(_prompts(tok)[1:2], SamplingParams(max_tokens=30, ignore_eos=True,
                                                          guided_regex=choice_regex(COLOURS, "f")))[0]
    assert len(out) == 30 and tok.decode(out) in COLOURS
    n = next(i for i, t in enumerate(out) if t in eng.eos_token_ids)
    assert set(out[n:]) <= set(eng.eos_token_ids)


def test_engine_without_a_tokenizer_takes_the_checkpoints(model, tok, tiny_model_dir):
    """A cluster instance serves ids only: its vocabulary comes from its model's directory."""
    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir), policy="fcfs", packer="token",
                                   kv_cache_tokens=4096, num_threads=1), model)
    sp = SamplingParams(max_tokens=30, guided_regex=CODE)
    assert plain.generate([tok.encode("Code:")], sp) == _engine(model, tok).generate([tok.encode("Code:")], sp)


def _completion(**fields):
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_request_fields_become_one_pattern():
    assert pattern_of(_completion()) is None
    assert pattern_of(_completion(response_format={"type": "text"})) is None
    field, pat = pattern_of(_completion(response_format={"type": "json_schema",
                                                         "json_schema": {"name": "p", "schema": SCHEMA}}))
    assert field == "response_format" and pat == Regex(schema_regex(SCHEMA, "f"))
    assert pattern_of(_completion(response_format={"type": "json_object"})) == ("response_format",
                                                                                 Regex(json_object_regex()))
    assert pattern_of(_completion(structured_outputs={"choice": COLOURS})) == (
        "structured_outputs.choice", Regex(r"(red|green|light blue \(sky\))"))
    assert pattern_of(_completion(structured_outputs={"regex": CODE})) == ("structured_outputs.regex", Regex(CODE))
    assert pattern_of(_completion(structured_outputs={"json": json.dumps(SCHEMA)}))[1] == Regex(schema_regex(SCHEMA, "f"))
    assert pattern_of(_completion(structured_outputs={"grammar": PARENS})) == ("structured_outputs.grammar",
                                                                               Grammar(PARENS))
    assert pattern_of(_completion(guided_choice=["a", "b"])) == ("guided_choice", Regex("(a|b)"))
    assert pattern_of(_completion(guided_regex="[0-9]+")) == ("guided_regex", Regex("[0-9]+"))
    assert pattern_of(_completion(guided_grammar=PARENS_GBNF)) == ("guided_grammar", Grammar(PARENS_GBNF))
    compact = pattern_of(_completion(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}))[1].text
    assert "[ ]?" not in compact and re.fullmatch(compact, '{"name":"a","age":3,"pets":["cat"],"ok":true}')
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "guided_json": SCHEMA})
    assert pattern_of(chat) == ("guided_json", Regex(schema_regex(SCHEMA, "f")))


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
    ({"guided_grammar": PARENS, "guided_regex": "a"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
])
def test_conflicting_or_broken_fields_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        pattern_of(_completion(**fields))
    assert e.value.field == param


def test_token_bytes_spell_every_text_byte_for_byte(tok):
    inverse = {i: b for b, ids in tok.token_bytes().items() for i in ids}
    special = set(range(6))
    assert special.isdisjoint(inverse) and len(inverse) == tok.vocab_size - len(special)
    for text in ("Hello world", "  two  spaces\tand a tab\n", "café über naïve ñ", "日本語のテキスト 🙂", "{\"a\": [1, 2]}"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(inverse[i] for i in ids) == text.encode()


def test_token_bytes_of_a_sentencepiece_style_tokenizer(tmp_path):
    """Llama-2 / Mistral spell a space U+2581 and unknown bytes <0xXX> (byte fallback)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=[],
                                  limit_alphabet=60)
    hf.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    hf.add_tokens([b for b in bytes_ if hf.token_to_id(b) is None])
    # Byte tokens must be ordinary vocabulary entries, as in a real SentencePiece file.
    spec = json.loads(hf.to_str())
    vocab = spec["model"]["vocab"]
    for t in spec["added_tokens"]:
        if t["content"].startswith("<0x"):
            vocab[t["content"]] = t["id"]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    sp = Tokenizer(tmp_path)
    inverse = {i: b for b, ids in sp.token_bytes().items() for i in ids}
    for text in ("the lazy fox", "a jumpy dog é"):
        ids = sp.encode(text, add_special_tokens=False)
        assert b"".join(inverse[i] for i in ids).lstrip(b" ") == text.encode()


def test_the_gateway_refuses_a_pattern_that_compiles_too_long(tok):
    """`(.{0,100}x){0,10}` takes about a minute over this vocabulary: the child compiling it is
    stopped at the limit, and the next pattern compiles in a fresh one."""
    import asyncio
    import time

    from raycluster.server.structured import PatternCheck

    check = PatternCheck(tok, timeout_s=1.5)

    async def main():
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError) as e:
            await check.check("guided_regex", Regex("(.{0,100}x){0,10}"))
        assert "too complex" in str(e.value) and e.value.field == "guided_regex"
        assert time.monotonic() - t0 < 30
        with pytest.raises(InvalidRequestError) as e:
            await check.check("structured_outputs.regex", Regex("(unclosed"))
        assert "cannot be compiled" in str(e.value) and e.value.field == "structured_outputs.regex"
        await check.check("guided_regex", Regex(CODE))
        await check.check("guided_regex", Regex(CODE))         # remembered: no second compile
        for bad, why in (("start: undefined_rule", "unknown name"), ("root ::= [", "GBNF"), ("start: (", "")):
            with pytest.raises(InvalidRequestError) as e:
                await check.check("structured_outputs.grammar", Grammar(bad))
            assert e.value.field == "structured_outputs.grammar" and why in str(e.value)
        await check.check("guided_grammar", Grammar(PARENS_GBNF))

    try:
        asyncio.run(main())
    finally:
        check.close()
    assert list(check._ok) == [CODE, Grammar(PARENS_GBNF)]


def test_guided_bench_writes_its_figures(tmp_path, tiny_model_dir):
    from raycluster.bench import guided_bench

    out = tmp_path / "g.json"
    assert guided_bench.main(["--model", str(tiny_model_dir), "--num-requests", "3", "--max-tokens", "12",
                              "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["valid"] and res["guided_over_free"] > 0 and res["grammar_over_free"] > 0
    assert set(res["tokens_per_s"]) == {"free", "guided", "grammar"}
    assert all(res["mask_ms_per_step"][k] > 0 and res["compile_s"][k] > 0 for k in ("guided", "grammar"))


def test_the_bench_grammar_writes_the_bench_schemas_objects(model, tok):
    """The guided bench compares a regex and a grammar: the grammar's finished sentences are
    the schema regex's (greedy and sampled, until EOS)."""
    from raycluster.bench.guided_bench import GRAMMAR, SCHEMA

    regex = schema_regex(SCHEMA, "s")
    eng = _engine(model, tok)
    finished = 0
    for sp in (SamplingParams(max_tokens=200, guided_grammar=GRAMMAR),
               SamplingParams(max_tokens=200, temperature=1.0, seed=1, guided_grammar=GRAMMAR)):
        for out in eng.generate(_prompts(tok), sp):
            if out[-1] in eng.eos_token_ids:
                finished += 1
                assert re.fullmatch(regex, tok.decode(out[:-1])), tok.decode(out)
    assert finished >= 4


def _parens_depth(text: str) -> int:
    """k for '(' * k + 'x' + ')' * k, else an AssertionError."""
    k = len(text) - len(text.lstrip("("))
    assert text == "(" * k + "x" + ")" * k, text
    return k


@pytest.mark.parametrize("grammar", [PARENS, PARENS_GBNF], ids=["lark", "gbnf"])
def test_every_output_is_a_sentence_of_its_grammar(model, tok, grammar):
    """Greedy and sampled: each output is balanced (depth up to 12 with 40 tokens), and the
    grammar's parser leaves EOS as the only choice once it is complete."""
    eng = _engine(model, tok)
    prompts = _prompts(tok)
    depths = []
    for sp in (SamplingParams(max_tokens=40, guided_grammar=grammar),
               SamplingParams(max_tokens=40, temperature=1.0, seed=3, guided_grammar=grammar)):
        outs = eng.generate(prompts * 2, sp)
        for out in outs:
            assert out[-1] in eng.eos_token_ids        # it ended because the sentence did
            depths.append(_parens_depth(tok.decode(out[:-1])))
    assert max(depths) > 0          # not only the trivial sentence 'x'
    eng.kv.check()


def test_a_resumed_grammar_request_continues_exactly(model, tok):
    """A request resumed with the tokens it had (a P/D handoff, a router restart) replays them
    into a fresh parser: the whole output equals one engine's (greedy), token for token."""
    sp = SamplingParams(max_tokens=40, guided_grammar=PARENS)
    prompt = tok.encode("{")
    whole = _engine(model, tok).generate([prompt], sp)[0]
    assert tok.decode(whole[:-1]) == "(x)"         # this model's greedy sentence for this prompt
    for cut in (1, 2):
        assert _resumed(model, tok, prompt, sp, whole[:cut]) == whole


def test_engine_refuses_a_grammar_it_cannot_compile(model, tok):
    eng = _engine(model, tok)
    for bad in ("start: nothing_here", "root ::= [", "x" * 70000):
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request("r", [7, 8], SamplingParams(max_tokens=4, guided_grammar=bad))
        assert e.value.field == "guided_grammar"
    with pytest.raises(ValueError, match="guided_grammar"):
        SamplingParams(max_tokens=4, guided_regex="a", guided_grammar=PARENS).validate()
