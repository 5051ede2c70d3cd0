"""The router's guess of which prompt prefixes each instance has in its prefix cache.

Instances with `enable_prefix_caching` keep the KV of full blocks findable by a SHA-256 chain
over their tokens (raycluster.engine.prefix_cache). The router cannot see those caches, so it
remembers the block keys of the prompts it sent to each instance (and of the output a request
left there), most recent last, bounded by the instance's KV size: an approximate index in the
spirit of SGLang's cache-aware router.
Dispatch asks `matched_tokens(instance, keys)` (the leading blocks of a prompt the instance
probably still holds) and counts only the rest of the prompt as prefill work for that instance,
so a prompt goes where its prefix is unless that instance is busier by more than the prefix.

Data in: `prompt_keys(tokens, block_size)` once per request (`extend_keys` over its output when
it ends), `record` when work is sent or ends, `forget` when an instance leaves or re-registers.
Out: matched token counts. Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict

from raycluster.engine.prefix_cache import block_key, chain_root, image_extras


def prompt_keys(tokens: list[int], block_size: int, lora_adapter: str | None = None, images=()) -> list[bytes]:
    """Keys of the full blocks an engine could reuse for `tokens` (never the last token's), run
    with `lora_adapter` (None: the base weights), with the prompt's `images`."""
    return extend_keys([], tokens, block_size, lora_adapter, images)


def extend_keys(keys: list[bytes], tokens: list[int], block_size: int,
                lora_adapter: str | None = None, images=()) -> list[bytes]:
    """`keys` (those of a prefix of `tokens`) continued over `tokens`' further full blocks (never
    the last token's); a new list, `keys` untouched."""
    out, parent = list(keys), keys[-1] if keys else chain_root(lora_adapter)
    extras = image_extras(images, block_size)
    for i in range(len(keys), (len(tokens) - 1) // block_size):
        parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size], extras.get(i, b""))
        out.append(parent)
    return out


class PrefixIndex:
    def __init__(self) -> None:
        self._keys: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, instance_id: str, keys: list[bytes], capacity_blocks: int) -> None:
        """`instance_id` was sent a prompt with these block keys; it keeps at most
        `capacity_blocks` (its KV size), least recently sent dropped first."""
        if not keys or capacity_blocks <= 0:
            return
        held = self._keys.setdefault(instance_id, OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > capacity_blocks:
            held.popitem(last=False)

    def matched_blocks(self, instance_id: str, keys: list[bytes]) -> int:
        held = self._keys.get(instance_id)
        if not held:
            return 0
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def forget(self, instance_id: str) -> None:
        self._keys.pop(instance_id, None)

    def size(self, instance_id: str) -> int:
        return len(self._keys.get(instance_id, ()))
