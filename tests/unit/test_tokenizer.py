"""Tokenizer round trip, tiny checkpoint determinism, streaming detokenization, chat template."""

import filecmp
import os

import pytest

from raycluster.model import Tokenizer, write_tiny_model
from raycluster.model.tiny import BOS_ID, EOS_ID

TEXTS = [
    "The river town woke slowly on winter mornings.",
    "Numbers: 3.14159, 2**10 = 1024; tabs\tand\nnewlines.",
    "Unicode: café, Zürich, 東京, Москва, emoji 🙂🚀👍🏽 and ❤️!",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir, model_eos_token_ids=(EOS_ID, 7))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == BOS_ID  # tiny tokenizer adds BOS, like Llama
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_special_tokens_and_eos_union(tok):
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eos|>"
    assert tok.eos_token_ids == (EOS_ID, 7)
    assert 1000 < tok.vocab_size <= 4096
    assert tok.encode("<|user|>", add_special_tokens=False) == [3]


def test_write_tiny_model_is_deterministic(tmp_path, tiny_model_dir):
    from raycluster.model import tiny
    tiny._tokenizer_json.cache_clear()  # retrain the tokenizer too
    a = write_tiny_model(tmp_path / "a", seed=0)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(os.path.join(a, name), os.path.join(tiny_model_dir, name), shallow=False), name
    b = write_tiny_model(tmp_path / "b", seed=1)
    assert not filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(b, "model.safetensors"),
                           shallow=False)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode(tok, text):
    prompt = tok.encode("Hello there.")
    ids = tok.encode(text, add_special_tokens=False)
    det = tok.incremental_detokenizer(prompt)
    pieces = [det.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + det.flush() == tok.decode(ids)
    assert "".join(pieces) == tok.decode(ids)  # nothing held back at a clean end


def test_incremental_detokenizer_holds_back_partial_char(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    if len(ids) < 2:
        pytest.skip("emoji is a single token in this vocab")
    det = tok.incremental_detokenizer()
    assert det.add(ids[0]) == ""
    assert "".join(det.add(t) for t in ids[1:]) == "🙂"
    # A truncated character is only released by flush().
    det2 = tok.incremental_detokenizer()
    det2.add(ids[0])
    assert det2.flush() == tok.decode(ids[:1])


def test_incremental_detokenizer_skips_special_tokens(tok):
    det = tok.incremental_detokenizer()
    out = "".join(det.add(t) for t in tok.encode("Hi") + [EOS_ID])
    assert out == "Hi"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nHi!<|eos|>\n<|assistant|>\n"
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids[-2:] == [4, tok.encode("\n", add_special_tokens=False)[0]]
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|assistant|>\n")


def test_chat_template_matches_transformers(tiny_model_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "user", "content": "What time is it?"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False,
                                                                    add_generation_prompt=True)
    assert tok.encode(TEXTS[2]) == hf(TEXTS[2])["input_ids"]


def test_default_template_without_config(tmp_path, tiny_model_dir):
    import shutil
    shutil.copy(os.path.join(tiny_model_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    t = Tokenizer(tmp_path)
    assert t.eos_token_ids == ()
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"


def test_chat_template_kwargs_reach_the_template_as_in_transformers(tiny_model_dir, tok):
    """vLLM's chat_template_kwargs are HF's apply_chat_template **kwargs: more template variables
    (e.g. Qwen3's enable_thinking); one naming a variable the call sets itself is refused."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    saved = tok.chat_template
    tok.chat_template, tok._compiled = template, None
    msgs = [{"role": "user", "content": "hi"}]
    try:
        for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
            assert tok.apply_chat_template(msgs, template_kwargs=kwargs) == \
                hf.apply_chat_template(msgs, tokenize=False, chat_template=template, **kwargs)
        assert tok.apply_chat_template(msgs, template_kwargs={"enable_thinking": False}) == "hi<no-think>"
        with pytest.raises(ValueError, match="chat_template_kwargs: messages"):
            tok.apply_chat_template(msgs, template_kwargs={"messages": []})
    finally:
        tok.chat_template, tok._compiled = saved, None


HUB_STYLE_TEMPLATE = (
    # What Hub templates use beyond plain Jinja: strftime_now (Llama 3.1+), tojson with
    # indent and no HTML escaping (Qwen2.5 / Llama tool schemas), break (loopcontrols),
    # {% generation %} (assistant masks), dict(), raise_exception.
    "{{ bos_token }}Today: {{ strftime_now('%Y-%m') }}\n"
    "{% if tools %}{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.role }}: {{ m.content | tojson }}{% endif %}\n{% endfor %}"
    "{% set d = dict(a=1) %}{{ d.a }}"
    "{% if messages | length > 9 %}{{ raise_exception('too many') }}{% endif %}"
)


def test_hub_template_features_render_as_in_transformers(tiny_model_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "f", "description": "a < b & c > 'd' é",
                                                "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "x <y> & 'z' é"}, {"role": "assistant", "content": "ok"},
            {"role": "stop", "content": ""}, {"role": "user", "content": "never shown"}]
    saved = tok.chat_template
    tok.chat_template, tok._compiled = HUB_STYLE_TEMPLATE, None
    try:
        ours = tok.apply_chat_template(msgs, add_generation_prompt=False, tools=tools)
        theirs = hf.apply_chat_template(msgs, tokenize=False, chat_template=HUB_STYLE_TEMPLATE, tools=tools)
        assert ours == theirs
        assert '"description": "a < b & c > \'d\' é"' in ours and "never shown" not in ours
        with pytest.raises(ValueError, match="too many"):
            tok.apply_chat_template([{"role": "user", "content": "x"}] * 10)
    finally:
        tok.chat_template, tok._compiled = saved, None


def test_a_chat_template_given_as_text_or_file_replaces_the_checkpoints(tiny_model_dir, tmp_path):
    """vLLM's --chat-template: the text, or a file holding it, is used instead of the checkpoint's;
    ClusterConfig refuses inline text that does not parse, naming the field."""
    from pydantic import ValidationError

    from raycluster.cluster.config import ClusterConfig

    msgs = [{"role": "user", "content": "hi"}]
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    t = Tokenizer(tiny_model_dir)
    t.apply_chat_template(msgs)             # compiled the checkpoint's first
    t.set_chat_template(template)
    assert t.apply_chat_template(msgs) == "[user] hi\n>"
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content | upper }}")
    t.set_chat_template(str(f))
    assert t.apply_chat_template(msgs) == "HI" and t.chat_template == "{{ messages[0].content | upper }}"
    assert ClusterConfig(chat_template=template).chat_template == template
    assert ClusterConfig(chat_template="/models/templates/chat.jinja").chat_template     # a path on the nodes
    with pytest.raises(ValidationError, match="chat_template\n.*does not parse"):
        ClusterConfig(chat_template="{% for m in messages %}")
