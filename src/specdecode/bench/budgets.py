"""Engines under memory pressure: an `LLM` whose memory budget holds its weights, the activations' reserve and
exactly `blocks` KV blocks in every pool, whatever the model's sizes (for benchmarks and tests of admission,
preemption and prefix sharing)."""

from __future__ import annotations

import gc

from specdecode.engine.llm import LLM


def budget_holding(blocks: int, **options) -> int:
    """The memory budget, in bytes, that gives `LLM(**options)` room for `blocks` KV blocks and no more."""
    llm = LLM(**options)
    budget = llm.memory_plan.budget_holding(blocks)
    del llm
    gc.collect()  # its weights and caches go before the next engine loads
    return budget


def llm_holding(blocks: int | None, **options) -> LLM:
    """`LLM(**options)` with room for `blocks` KV blocks (None: the budget the options give)."""
    if blocks is None:
        return LLM(**options)
    return LLM(**options, memory_budget=budget_holding(blocks, **options))
