"""A checkpoint's generation_config.json as vLLM reads it by default (`--generation-config auto`).

Two things come from it: more end-of-sequence ids (`eos_token_id`, an int or a list; HF's
`generate` stops on each, and so do vLLM and this engine unless a request sets `ignore_eos`),
and the model creator's default sampling parameters (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` as the default `max_tokens`), which the HTTP app
applies to every request field the client left out. Only keys present in the file count (not
HF's class defaults), and `do_sample` is not read, as in vLLM. A missing file gives nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float | int] = field(default_factory=dict)   # request field -> default


def load_generation_config(path: str | os.PathLike) -> GenerationDefaults:
    """The defaults in `path`/generation_config.json (`path` a checkpoint directory)."""
    file = os.path.join(os.fspath(path), "generation_config.json")
    if not os.path.isfile(file):
        return GenerationDefaults()
    try:
        with open(file, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: {e}") from e
    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(x) for x in (eos if isinstance(eos, list) else [eos]))
    sampling: dict[str, float | int] = {k: d[k] for k in SAMPLING_KEYS if d.get(k) is not None}
    if d.get("max_new_tokens") is not None:
        sampling["max_tokens"] = int(d["max_new_tokens"])
    return GenerationDefaults(eos_ids, sampling)
