"""Compiles a checkpoint's chat template in the Jinja environment Hugging Face renders it in.

Templates on the Hub are written against `transformers`' `apply_chat_template`, which adds to a
sandboxed Jinja environment (trim_blocks, lstrip_blocks): the loop-controls extension (`break`,
`continue`), a `{% generation %}` block (marks assistant text for training masks; rendered as
is here), a `tojson` filter that does not HTML-escape and takes `indent` / `separators` /
`sort_keys` (Jinja's own escapes `<`, `>`, `&`, `'`, which changes tool schemas in the prompt),
and the globals `raise_exception`, `strftime_now` (Llama 3.1+ templates date their system
prompt with it) and `dict`. A template using any of them fails or renders other text in a bare
environment. Text enters as the template string; a compiled `jinja2.Template` leaves.
"""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: the body, unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise ValueError(message)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args, **kwargs) -> dict:
    # A function, not the type itself: a template gets dicts, not dict's class attributes.
    return dict(*args, **kwargs)


def compile_chat_template(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_dict)
    return env.from_string(template)
