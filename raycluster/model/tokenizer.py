"""Tokenizer: a `tokenizers.Tokenizer` loaded from tokenizer.json plus tokenizer_config.json
(special tokens, add_bos, chat template), streaming detokenization that never emits a
broken multi-byte character, and each token's bytes (`token_bytes`, for structured outputs)."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):  # older files store AddedToken dicts
        return tok.get("content")
    return tok


class Tokenizer:
    def __init__(self, path: str | os.PathLike, model_eos_token_ids: tuple[int, ...] | list[int] = ()):
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}")
        self._tok = HFTokenizer.from_file(tj)
        # A sentence-transformers model's `do_lower_case` (sentence_bert_config.json): its texts
        # are lowercased before tokenizing, as sentence-transformers and vLLM do.
        from raycluster.model.pooling import PoolerConfigError, sentence_transformers_options
        try:
            self.lower_case = bool(sentence_transformers_options(path).get("do_lower_case"))
        except PoolerConfigError:
            self.lower_case = False
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        ids = set(model_eos_token_ids)
        if eos_id is not None:
            ids.add(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(ids))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        processor_file = os.path.join(path, "chat_template.json")    # a processor's (llava-hf's releases)
        if template is None and os.path.exists(processor_file):
            with open(processor_file, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled = None

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja text, or the path of a file holding it) instead of the
        checkpoint's (vLLM's --chat-template)."""
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        from raycluster.model.chat_template import compile_chat_template

        self._compiled = compile_chat_template(template)      # a template that does not parse fails here
        self.chat_template = template

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its tokenizer from)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of a token id (None: not in the vocabulary)."""
        return self._tok.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_bytes(self) -> dict[bytes, list[int]]:
        """The bytes each ordinary token stands for -> its ids (special / added tokens left out).
        Byte-level BPE (GPT-2, Llama-3, Qwen2) spells bytes as printable characters; SentencePiece
        BPE (Llama-2, Mistral) writes a space as U+2581 and a byte it cannot spell as <0xXX>."""
        added = set(self._tok.get_added_tokens_decoder())      # id -> AddedToken
        byte_level = "ByteLevel" in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        unbyte = _unicode_to_byte() if byte_level else None
        out: dict[bytes, list[int]] = {}
        for tok, i in self._tok.get_vocab(with_added_tokens=False).items():
            if i in added:
                continue
            if unbyte is not None:
                b = bytes(unbyte[c] for c in tok) if all(c in unbyte for c in tok) else tok.encode()
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                b = bytes([int(tok[3:5], 16)])
            else:
                b = tok.replace("\u2581", " ").encode()
            out.setdefault(b, []).append(i)
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """ValueError for text that is not valid Unicode (a lone surrogate, which JSON's \\ud800
        escapes can carry): it has no UTF-8 bytes to tokenize."""
        try:
            ids = self._tok.encode(text.lower() if self.lower_case else text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("is not valid Unicode (it holds a lone surrogate)") from None
            raise
        # tokenizer_config may ask for BOS even when tokenizer.json's post-processor does not add it.
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def token_id(self, token: str) -> int | None:
        """A token's id by its vocabulary string (transformers' convert_tokens_to_ids), or None."""
        return self._tok.token_to_id(token)

    def encode_pair(self, first: str, second: str, add_special_tokens: bool = True) -> list[int]:
        """The two texts as one sequence, joined as the tokenizer's pair template says (what a
        cross-encoder reads: transformers' `tokenizer(first, second)`)."""
        return self.pair_encoding(first, second, add_special_tokens)[0]

    def pair_encoding(self, first: str, second: str, add_special_tokens: bool = True) -> tuple[list[int], int]:
        """(`encode_pair`'s ids, the position of the first token of type 1): transformers'
        `token_type_ids` are 0 up to there and 1 from there (0: the template types every token 0)."""
        try:
            if self.lower_case:
                first, second = first.lower(), second.lower()
            enc = self._tok.encode(first, pair=second, add_special_tokens=add_special_tokens)
        except TypeError:
            raise ValueError("is not valid Unicode (it holds a lone surrogate)") from None
        ids, start = enc.ids, next((i for i, t in enumerate(enc.type_ids) if t), 0)
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids, start = [self.bos_token_id] + ids, start + 1 if start else 0
        return ids, start

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, continue_final_message: bool = False,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None):
        """The chat template rendered over `messages`. `continue_final_message` (HF's and
        vLLM's): the text ends right after the last message's content, so the model continues
        that message (e.g. an assistant reply begun by the client) instead of starting a new
        turn; ValueError if the rendered text does not contain that content. `tools`: OpenAI
        tool definitions, for templates that render them (as HF's `tools`). `template_kwargs`:
        more variables for the template (HF's **kwargs, vLLM's chat_template_kwargs, e.g.
        Qwen3's enable_thinking); ValueError if one names a variable set here."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if self._compiled is None:
            from raycluster.model.chat_template import compile_chat_template

            self._compiled = compile_chat_template(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        fixed = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools)
        clash = sorted(set(template_kwargs or ()) & set(fixed))
        if clash:
            raise ValueError(f"chat_template_kwargs: {', '.join(clash)} cannot be set this way")
        text = self._compiled.render(**(template_kwargs or {}), **fixed)
        if continue_final_message:
            # As HF does: cut after the final content's last occurrence (templates may strip it).
            final = messages[-1]["content"] if messages else ""
            if isinstance(final, list):       # content parts (templates that iterate them)
                final = "".join(p.get("text", "") for p in final)
            final = final.strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ValueError("the chat template's text does not contain the final message to continue")
            text = text[:at + len(final)]
        if tokenize:
            return self.encode(text, add_special_tokens=False)  # the template places BOS itself
        return text

    def incremental_detokenizer(self, prompt_ids: list[int] | None = None,
                                skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted: printable bytes stand for
    themselves, the other 68 map to U+0100 upwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in keep}
    shifted = (b for b in range(256) if b not in set(keep))
    for n, b in enumerate(shifted):
        table[chr(256 + n)] = b
    return table


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word as it would start the text and, when that
    gives other tokens of the same count, as it would follow a space (so it is banned at the
    start and in the middle of text)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


class IncrementalDetokenizer:
    """Streams text token by token. Decodes a small window [prefix_offset:] and emits only text
    beyond the already-emitted part [prefix_offset:read_offset], holding back while it ends in
    U+FFFD (an incomplete multi-byte character)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 5, 0)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated character at the end of generation)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]
