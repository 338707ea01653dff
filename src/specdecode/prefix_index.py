"""KV blocks found by the tokens they hold, so that sequences share a computed prefix instead of computing and
storing it again: the `n` samples of one prompt, requests with a common system prompt, a chat's next turn.

A block is registered under its tokens and the prefix before it, named by the entry of the block before (a
chain from a root per scope: one tenant's blocks are never found from another's, since timing would tell one
what the other sent). Keys are compared exactly, never by a hash alone. A full block is shared by reference as
it is; a block that matches only in part (a finished sequence's last block, or a full one the new prompt leaves
at some token) is copied, since the new sequence writes into it. Registered blocks that no sequence holds stay
until the pool needs them, least recently released first; a sequence releases its blocks last to first, so a
prefix outlives the continuations that hang from it."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    uid: int  # names this block's whole prefix: the parent of the block after it
    tokens: tuple[int, ...]  # the block's own tokens (fewer than a block's for a finished sequence's last one)
    block: int


@dataclass
class Match:
    shared: list[Entry] = field(default_factory=list)  # full blocks to share, in order
    partial: Entry | None = None  # a block to copy, of which the first `partial_tokens` positions hold
    partial_tokens: int = 0

    def length(self, block_size: int) -> int:
        return len(self.shared) * block_size + self.partial_tokens


class PrefixIndex:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._children: dict[Hashable, dict[tuple[int, ...], Entry]] = {}  # parent -> the blocks after it
        self._parent: dict[int, Hashable] = {}  # registered block -> its parent
        self._entry: dict[int, Entry] = {}  # registered block -> its entry
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered blocks no sequence holds, oldest first
        self._uids = itertools.count()

    @staticmethod
    def root(scope: Hashable) -> Hashable:
        return ("scope", scope)

    # ---- finding ---------------------------------------------------------------------------------------
    def match(self, scope: Hashable, tokens: list[int], limit: int) -> Match:
        """The registered blocks holding the longest prefix of tokens, at most `limit` of them."""
        size, parent, shared = self.block_size, self.root(scope), []
        while (len(shared) + 1) * size <= limit:
            at = len(shared) * size
            entry = self._children.get(parent, {}).get(tuple(tokens[at : at + size]))
            if entry is None:
                break
            shared.append(entry)
            parent = entry.uid
        rest = tuple(tokens[len(shared) * size : limit])
        partial, best = None, 0
        for entry in self._children.get(parent, {}).values() if rest else ():
            n = common_prefix(entry.tokens, rest)
            if n > best:
                partial, best = entry, n
        return Match(shared, partial, best)

    def is_registered(self, block: int) -> bool:
        return block in self._entry

    # ---- registering -----------------------------------------------------------------------------------
    def register(self, parent: Hashable, tokens: tuple[int, ...], block: int) -> int:
        """Register block under (parent, tokens), unless these tokens after that parent are registered already
        (then the block stays private); the uid that names the prefix ending with these tokens."""
        siblings = self._children.setdefault(parent, {})
        if tokens in siblings:
            return siblings[tokens].uid
        entry = Entry(next(self._uids), tokens, block)
        siblings[tokens] = entry
        self._parent[block], self._entry[block] = parent, entry
        return entry.uid

    def unregister(self, block: int) -> None:
        """The block is about to be written: nobody finds it any more (the blocks after it can no longer be
        reached either, and go as the pool needs their space)."""
        entry, parent = self._entry.pop(block), self._parent.pop(block)
        del self._children[parent][entry.tokens]
        if not self._children[parent]:
            del self._children[parent]
        self._idle.pop(block, None)

    # ---- idle blocks -----------------------------------------------------------------------------------
    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def idle(self, block: int) -> None:
        self._idle[block] = None

    def busy(self, block: int) -> None:
        del self._idle[block]

    def evict(self) -> int | None:
        """The registered block released longest ago, unregistered for reuse (None: every one is held)."""
        if not self._idle:
            return None
        block = next(iter(self._idle))
        self.unregister(block)
        return block

    def clear(self) -> list[int]:
        """Forget every block; those no sequence held, to go back to the pool."""
        idle = list(self._idle)
        self._children.clear()
        self._parent.clear()
        self._entry.clear()
        self._idle.clear()
        return idle


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
