"""Which waiting requests the KV cache can take: a sequence is admitted only while the pool has blocks for its
longest length beside what the running ones may come to hold, so a request waits rather than runs out of
memory midway (and a request that could never fit is refused up front)."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import SpecDecodeError
from ..executor.runner import ModelRunner
from ..kv_cache import blocks_for
from ..sampling import SamplingParams
from .sequence import Sequence


class BlockBudget:
    def __init__(self, runner: ModelRunner, k_max: Callable[[], int]):
        self.runner, self.k_max = runner, k_max
        self.promised = 0  # blocks the running sequences may come to hold

    def blocks_for(self, prompt_tokens: int, params: SamplingParams) -> int:
        """A sequence's most blocks: its prompt and max_tokens, and a verify's drafts past them."""
        longest = min(self.runner.max_len, prompt_tokens + params.max_tokens + self.k_max() + 1)
        return blocks_for(longest, self.runner.block_size)

    def check(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse, saying what to change, a request the context or the whole pool could never hold."""
        if prompt_tokens >= self.runner.max_len:
            raise SpecDecodeError(
                f"the prompt has {prompt_tokens} tokens but the context holds {self.runner.max_len}; "
                "shorten the prompt or raise max_model_len"
            )
        need = params.n * self.blocks_for(prompt_tokens, params)
        if need > self.runner.num_blocks:
            tokens = self.runner.num_blocks * self.runner.block_size
            raise SpecDecodeError(
                f"the request may hold {need * self.runner.block_size} tokens of KV cache ({params.n} x (prompt + "
                f"max_tokens)) and the cache holds {tokens} in all; lower max_tokens or n, or raise the memory budget"
            )

    def admit(self, group: list[Sequence]) -> bool:
        """Promise the group its blocks if the pool has them beside the running sequences'."""
        blocks = sum(self.blocks_for(len(s.prompt_ids), s.params) for s in group)
        if self.promised + blocks > self.runner.num_blocks:
            return False
        self.promised += blocks
        return True

    def release(self, seq: Sequence) -> None:
        self.promised -= self.blocks_for(len(seq.prompt_ids), seq.params)
