"""Structured-output request fields -> the one regular expression or grammar the engine enforces.

A request may ask for its output's shape in one of the ways OpenAI and vLLM clients do:
- OpenAI's `response_format`: `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}` (`"text"` asks for nothing);
- vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice` (a list of strings),
  `json_object: true`, `grammar` (a context-free grammar in Lark or GBNF syntax);
- vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`;
- a forced tool call (`tool_choice` "required" or a named function: raycluster.server.tools).
At most one of them. `pattern_of(body)` returns (the field it came from, a `Regex` or a
`Grammar`), or None, or raises `InvalidRequestError` naming the field. JSON schemas become
regexes through outlines-core; grammars stay grammars (llguidance enforces them).
`PatternCheck` compiles each new regex at the gateway, in a child process with a time limit
(raycluster.engine.guided_compile), so a pattern the engine could not enforce, or could only
after minutes of compiling, is a 400 naming the client's field before any instance sees it; a
grammar is compiled in a thread (llguidance bounds its own work; the text is bounded in size).

JSON whitespace is one optional space by default (`[ ]?`; vLLM's `whitespace_pattern` /
`guided_whitespace_pattern` set another, `disable_any_whitespace` none): a pattern allowing any
run of whitespace lets a model emit spaces until max_tokens. `json_object` is an object whose
values are strings, numbers, booleans, null, or objects / arrays of those (two levels): the
regex of arbitrary nesting compiles for seconds even over a 4K-token vocabulary.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

from raycluster.engine.engine import InvalidRequestError
from raycluster.engine.guided import MAX_REGEX_CHARS, Grammar, Regex, GuidedVocab
from raycluster.engine.guided_compile import PatternCompiler
from raycluster.server.tools import tool_schema

DEFAULT_WHITESPACE = r"[ ]?"
_REGEX_SPECIAL = set("\\.^$|?*+()[]{}-&~#")


def escape(text: str) -> str:
    """`text` as a regex matching just itself (for the Rust regex syntax outlines-core uses:
    only punctuation is escaped, never letters or spaces)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def choice_regex(choices: list[str], field: str) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
    return "(" + "|".join(escape(c) for c in choices) + ")"


def json_object_regex(ws: str = DEFAULT_WHITESPACE) -> str:
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING

    def obj(value: str) -> str:
        pair = f"{STRING}{ws}:{ws}{value}"
        return rf"\{{{ws}({pair}({ws},{ws}{pair})*)?{ws}\}}"

    def arr(value: str) -> str:
        return rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"

    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
    return obj(f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL}|{obj(scalar)}|{arr(scalar)})")


def schema_regex(schema, field: str, ws: str = DEFAULT_WHITESPACE) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(field, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(field, "must be a JSON schema (an object)")
    try:
        return build_regex_from_schema(json.dumps(schema), ws)
    except Exception as e:      # outlines-core raises ValueError / TypeError / its own errors
        raise InvalidRequestError(field, f"is not a JSON schema this server can enforce: {e}") from None


def pattern_of(body, tool_mode: str | None = None) -> tuple[str, Regex | Grammar] | None:
    """(field, constraint): the regex or grammar `body` (a completion or chat request) asks its
    output to match and the field that asked, or None. `tool_mode`: the request's resolved tool
    choice (raycluster.server.tools.tool_mode)."""
    asked: list[tuple[str, object]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        asked.append(("response_format", rf))
    so = body.structured_outputs
    if so is not None:
        asked.append(("structured_outputs", so))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            asked.append((name, getattr(body, name)))
    tool = tool_schema(body, tool_mode)
    if tool is not None:        # a forced tool call: its arguments' schema is the pattern
        asked.insert(0, ("tool_choice", tool))
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequestError(asked[1][0], f"only one structured output per request (also {asked[0][0]})")
    name, spec = asked[0]
    if name == "tool_choice":
        field, schema = spec
        return field, Regex(schema_regex(schema, field, DEFAULT_WHITESPACE if body.guided_whitespace_pattern is None
                                         else body.guided_whitespace_pattern))
    if name == "structured_outputs":
        return _vllm_pattern(spec)
    if name == "guided_grammar":
        return name, Grammar(_grammar_text(spec, name))
    return name, Regex(_pattern(name, spec, body.guided_whitespace_pattern))


def _grammar_text(text, field: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError(field, "must be a non-empty grammar (Lark or GBNF)")
    return text


def _pattern(name: str, spec, ws: str | None) -> str:
    ws = DEFAULT_WHITESPACE if ws is None else ws
    if name == "response_format":
        if spec.type == "json_object":
            return json_object_regex(ws)
        return schema_regex(spec.json_schema.schema_, "response_format.json_schema.schema", ws)
    if name == "guided_json":
        return schema_regex(spec, name, ws)
    if name == "guided_choice":
        return choice_regex(spec, name)
    return spec     # guided_regex


def _vllm_pattern(so) -> tuple[str, Regex | Grammar]:
    """(the sub-field that asked, its constraint) of vLLM's `structured_outputs`."""
    ws = "" if so.disable_any_whitespace else (so.whitespace_pattern if so.whitespace_pattern is not None
                                               else DEFAULT_WHITESPACE)
    kinds = [k for k in ("json_", "regex", "choice", "json_object", "grammar") if getattr(so, k) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidRequestError("structured_outputs", "set exactly one of json, regex, choice, json_object, grammar")
    kind = kinds[0]
    if kind == "json_":
        return "structured_outputs.json", Regex(schema_regex(so.json_, "structured_outputs.json", ws))
    if kind == "choice":
        return "structured_outputs.choice", Regex(choice_regex(so.choice, "structured_outputs.choice"))
    if kind == "json_object":
        return "structured_outputs.json_object", Regex(json_object_regex(ws))
    if kind == "grammar":
        return "structured_outputs.grammar", Grammar(_grammar_text(so.grammar, "structured_outputs.grammar"))
    return "structured_outputs.regex", Regex(so.regex)


class PatternCheck:
    """Compiles patterns against the gateway's tokenizer: one that cannot be compiled (or not
    within `timeout_s`) is the client's error, reported with the field it came from. Patterns
    (and grammars) that compiled are remembered (up to `remember`), so a repeated schema costs
    nothing."""

    def __init__(self, tokenizer, timeout_s: float = 10.0, remember: int = 256) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._compiler: PatternCompiler | None = None
        self._vocab: GuidedVocab | None = None          # for grammars, built at the first one
        self._ok: OrderedDict[str | Grammar, None] = OrderedDict()
        self._remember = remember

    async def check(self, field: str, constraint: Regex | Grammar) -> None:
        if isinstance(constraint, Grammar):
            return await self._check_grammar(field, constraint)
        regex = constraint.text
        if len(regex) > MAX_REGEX_CHARS:
            raise InvalidRequestError(field, f"the pattern has {len(regex)} characters; at most {MAX_REGEX_CHARS}")
        if self.tokenizer is None:
            return                  # an ids-only server: the engine checks it when the request arrives
        if self._known(regex):
            return
        if self._compiler is None:
            self._compiler = PatternCompiler(self.tokenizer.token_bytes(), self.tokenizer.eos_token_ids[0],
                                             self.timeout_s)
        why = await asyncio.to_thread(self._compiler.check, regex)
        if why is not None:
            raise InvalidRequestError(field, why)
        self._remember_ok(regex)

    async def _check_grammar(self, field: str, grammar: Grammar) -> None:
        if self.tokenizer is None or self._known(grammar):
            return
        if self._vocab is None:
            tok = self.tokenizer
            self._vocab = GuidedVocab({}, tok.eos_token_ids, tok.to_json(), tok.vocab_size)
        try:
            await asyncio.to_thread(grammar.compile, self._vocab)
        except ValueError as e:
            raise InvalidRequestError(field, str(e)) from None
        self._remember_ok(grammar)

    def _known(self, key) -> bool:
        if key in self._ok:
            self._ok.move_to_end(key)
            return True
        return False

    def _remember_ok(self, key) -> None:
        self._ok[key] = None
        if len(self._ok) > self._remember:
            self._ok.popitem(last=False)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
