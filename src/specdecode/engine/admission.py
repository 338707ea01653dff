"""Which waiting requests the KV cache can take, and which running sequences give their blocks back when it cannot
hold the next step of all. A group is admitted while every pool (the target's, and a drafter's) has room, beside
the blocks its sequences hold now, for what each admitted sequence may take in its next ADMISSION_LOOKAHEAD tokens
(no further than its longest length: prompt, max_tokens and a verify's drafts). Past that, a sequence is
admitted on trust: before each step, while the pools cannot hold every sequence's next step, the newest one is
preempted (Engine._make_room) and later recomputed from its tokens, from what the prefix cache still holds. A
request that could never fit alone is refused up front, so the oldest sequence always runs.

A block that sequences share (a common system prompt, a chat's earlier turns) is counted once, as held, and
each sequence is charged only for the blocks past those it holds; rollbacks stop at its committed tokens, past
every block it shares, so a shared block it holds is never given up and taken again
(docs/decisions.md#prefix-caching-per-tenant)."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import SpecDecodeError
from ..executor.runner import ModelRunner
from ..kv_cache import blocks_for
from ..proposers.base import Proposer
from ..sampling import SamplingParams
from .sequence import Sequence

# Tokens of growth admission leaves room for: a request with a short max_tokens is held whole (it never waits on
# another's growth); a long one holds its next few blocks, so that a new admission rarely preempts at once.
ADMISSION_LOOKAHEAD = 256


class BlockBudget:
    lookahead = ADMISSION_LOOKAHEAD

    def __init__(self, runner: ModelRunner, proposers: list[Proposer], k_max: Callable[[], int]):
        self.runner, self.proposers, self.k_max = runner, proposers, k_max

    @property
    def pools(self) -> list[tuple[ModelRunner, Callable[[Sequence], int | None]]]:
        """Each pool, and where a sequence's blocks are in it (None: nowhere yet)."""
        drafters = [(p.kv_pool(), p.kv_slot) for p in self.proposers if p.kv_pool() is not None]
        return [(self.runner, _target_slot), *drafters]

    def longest_blocks(self, prompt_tokens: int, params: SamplingParams) -> int:
        """A sequence's most blocks: its prompt and max_tokens, and a verify's drafts past them."""
        longest = min(self.runner.max_len, prompt_tokens + params.max_tokens + self.k_max() + 1)
        return blocks_for(longest, self.runner.block_size)

    def check(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse, saying what to change, a request the context or the whole pool could never hold (its samples
        counted apart: admission counts them so until they have shared the prompt)."""
        if prompt_tokens >= self.runner.max_len:
            raise SpecDecodeError(
                f"the prompt has {prompt_tokens} tokens but the context holds {self.runner.max_len}; "
                "shorten the prompt or raise max_model_len"
            )
        need = params.n * self.longest_blocks(prompt_tokens, params)
        if need > self.runner.num_blocks:
            tokens = self.runner.num_blocks * self.runner.block_size
            raise SpecDecodeError(
                f"the request may hold {need * self.runner.block_size} tokens of KV cache ({params.n} x (prompt + "
                f"max_tokens)) and the cache holds {tokens} in all; lower max_tokens or n, or raise the memory budget"
            )

    def fits(self, seqs: list[Sequence], lookahead: int | None = None) -> bool:
        """Whether every pool holds what these sequences hold now and may take in their next `lookahead` tokens
        of output (0: their next step)."""
        aheads = self.aheads(seqs, lookahead)  # the same in every pool: worked out once (a check every step)
        most = sum(aheads)  # what they may take at most, holding nothing yet: where that fits, no slot is looked at
        return all(
            runner.blocks_in_use() + most <= runner.num_blocks
            or self._needed(runner, slot_of, seqs, aheads) <= runner.num_blocks
            for runner, slot_of in self.pools
        )

    def may_fit(self, admitted: list[Sequence], group: list[Sequence], cached_tokens: int) -> bool:
        """Before a group takes anything: whether the target's pool could hold it at best (its first sequence
        sharing the `cached_tokens` found computed), and every drafter's pool the block each sequence may copy as it
        takes a found prefix, so that a group that cannot fit takes no blocks to give back, nor runs a pool out."""
        best = self.needed(self.runner, _target_slot, admitted) - cached_tokens // self.runner.block_size
        if best + sum(self.aheads(group)) > self.runner.num_blocks:
            return False
        drafters = self.pools[1:]
        return all(self.needed(pool, slot_of, admitted) + len(group) <= pool.num_blocks for pool, slot_of in drafters)

    def needed(
        self,
        runner: ModelRunner,
        slot_of: Callable[[Sequence], int | None],
        seqs: list[Sequence],
        lookahead: int | None = None,
    ) -> int:
        """The pool's blocks in use and those the sequences may take in their next `lookahead` tokens."""
        return self._needed(runner, slot_of, seqs, self.aheads(seqs, lookahead))

    def _needed(self, runner: ModelRunner, slot_of, seqs: list[Sequence], aheads: list[int]) -> int:
        need = runner.blocks_in_use()
        for seq, ahead in zip(seqs, aheads):
            slot = slot_of(seq)
            need += max(0, ahead - (0 if slot is None else runner.blocks_held(slot)))
        return need

    def aheads(self, seqs: list[Sequence], lookahead: int | None = None) -> list[int]:
        """The blocks each sequence holds once it has its context, its next step's rows, and `lookahead` more tokens
        of output (as far as its longest length; None: the admission's lookahead)."""
        lookahead = self.lookahead if lookahead is None else lookahead
        rows, longest, block_size = self.k_max() + 1, self.runner.max_len, self.runner.block_size
        return [
            blocks_for(min(longest, seq.num_tokens + rows + min(lookahead, seq.remaining_tokens)), block_size)
            for seq in seqs
        ]


def _target_slot(seq: Sequence) -> int | None:
    return seq.slot if seq.slot >= 0 else None
