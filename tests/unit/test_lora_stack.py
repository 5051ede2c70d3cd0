"""A step mixing LoRA adapters runs them through the set's stack (`StackedStepLoRA`): every row
gets exactly its own adapter's x A^T B^T (the plain formula), rows on no adapter nothing, with
adapters of different ranks, adapters skipping a projection, and the stack rebuilt as the set
changes; each adapter's weights live once, as views of the stack."""

from __future__ import annotations

import torch

from raycluster.model.lora import LoRAAdapter, LoRASet, StackedStepLoRA, StepLoRA

IN, OUT = 12, 10


def _adapter(name: str, rank: int, modules: tuple[str, ...], seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    ad = LoRAAdapter(name, f"/adapters/{name}", rank)
    for layer in range(2):
        for m in modules:
            ad.weights[(layer, m)] = (torch.randn(rank, IN, generator=g), torch.randn(OUT, rank, generator=g))
    return ad


def _reference(set_: LoRASet, runs, x, y, layer, module):
    """y plus, row by row, the row's adapter's update by the plain formula."""
    want = y.clone()
    for name, first, count in runs:
        ab = set_.adapters[name].weights.get((layer, module))
        if ab is not None:
            a, b = ab
            for t in range(first, first + count):
                want[t] += b @ (a @ x[t])
    return want


def _check(set_: LoRASet, runs, num_tokens: int, stacked: bool) -> None:
    step = set_.for_step(runs, num_tokens)
    assert isinstance(step, StackedStepLoRA if stacked else StepLoRA)
    g = torch.Generator().manual_seed(num_tokens)
    x, y = torch.randn(num_tokens, IN, generator=g), torch.randn(num_tokens, OUT, generator=g)
    for layer in range(2):
        for module in ("q_proj", "o_proj", "up_proj"):
            want = _reference(set_, runs, x, y, layer, module)
            got = step.add(layer, module, x, y.clone())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_mixed_step_gives_each_row_its_own_adapters_update():
    s = LoRASet([_adapter("a", 4, ("q_proj", "o_proj"), 1), _adapter("b", 8, ("q_proj", "up_proj"), 2),
                 _adapter("c", 2, ("o_proj",), 3)])
    # Rows on no adapter between runs; runs out of token order; one adapter twice: mostly
    # adapter rows (base rows masked out), then mostly base rows (adapter rows gathered).
    _check(s, [("b", 5, 3), ("a", 0, 2), ("c", 9, 1), ("a", 3, 1)], num_tokens=11, stacked=True)
    _check(s, [("c", 9, 1), ("a", 0, 1), ("b", 5, 2)], num_tokens=14, stacked=True)
    # Every row on some adapter: no gather.
    _check(s, [("a", 0, 4), ("b", 4, 2), ("c", 6, 3)], num_tokens=9, stacked=True)
    # One adapter alone keeps the per-adapter path.
    _check(s, [("b", 1, 3)], num_tokens=6, stacked=False)


def test_adapter_weights_are_views_of_the_stack_and_it_follows_the_set():
    a, b, c = _adapter("a", 4, ("q_proj",), 1), _adapter("b", 8, ("q_proj", "o_proj"), 2), _adapter("c", 2, ("o_proj",), 3)
    a_q = a.weights[(0, "q_proj")][0].clone()
    s = LoRASet([a, b])
    stack = s.stack()
    assert stack.width == 12 and stack.cols == {"a": (0, 4), "b": (4, 12)}
    a_all, bt_all = stack.weights[(0, "q_proj")]
    assert a.weights[(0, "q_proj")][0].data_ptr() == a_all.data_ptr()
    assert b.weights[(0, "q_proj")][1].data_ptr() == bt_all[4:].data_ptr()
    assert torch.equal(a.weights[(0, "q_proj")][0], a_q)
    assert torch.equal(stack.weights[(0, "o_proj")][0][:4], torch.zeros(4, IN))   # a skips o_proj
    assert s.stack() is stack                                                     # unchanged set: reused
    s.add(c)
    s.retire("a")
    _check(s, [("a", 0, 2), ("c", 2, 3), ("b", 6, 1)], num_tokens=7, stacked=True)  # a still running
    s.collect(in_use=set())
    assert s.stack().cols == {"b": (0, 8), "c": (8, 10)}
    _check(s, [("c", 0, 3), ("b", 4, 2)], num_tokens=6, stacked=True)


def test_a_wide_stack_with_few_columns_in_use_loops_over_the_steps_adapters():
    # 2 + 2 columns used of 2 + 2 + 64: more than LoRASet.MAX_STACK_WIDTH_PER_USED_COLUMN per column.
    s = LoRASet([_adapter("a", 2, ("q_proj",), 1), _adapter("b", 2, ("q_proj",), 2),
                 _adapter("big", 64, ("q_proj",), 3)])
    _check(s, [("a", 0, 2), ("b", 2, 2)], num_tokens=5, stacked=False)
    _check(s, [("a", 0, 2), ("big", 2, 2)], num_tokens=5, stacked=True)
