"""A depth-limited suffix trie with occurrence counts: every substring of up to `depth` tokens of the texts
fed to it is a path from the root, each node counts how often its substring occurred and remembers where
it last ended. Appending a token touches `depth` nodes (one per suffix ending there), so a sequence is
indexed as it grows, never rebuilt; removing a text replays its insertion with counts going down, which
is how a bounded cache of earlier outputs forgets one.

A draft continues the longest suffix of the context that occurred before with a continuation: it follows
the most frequent child while the product of the branch frequencies (how often that continuation
followed this context) stays above `min_prob`. Once the path has occurred only once, its continuation is
the text after that occurrence, copied up to the length asked for: the trie's depth bounds the context
it matches on, not how far a draft reaches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Bytes per trie node on CPython 3.11 (its list entries, its count and position, its share of child maps),
# measured by tests/test_suffix.py: what a cache's byte cap counts.
NODE_BYTES = 270
POSITION_BITS = 32  # a node's last occurrence: text id << POSITION_BITS | index of its last token


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # per token: P(it follows | the ones before it did)
    match: int = 0  # length of the context suffix it continues
    source: int | None = None  # id of the text it was copied from, where it ends in a copy

    @property
    def expected_tokens(self) -> float:
        """Expected accepted tokens if each is right with its probability."""
        total, p = 0.0, 1.0
        for q in self.probs:
            p *= q
            total += p
        return total


@dataclass
class SuffixTrie:
    depth: int = 24  # longest substring indexed: a context match is at most depth - 1 tokens
    counts: list[int] = field(default_factory=lambda: [0])  # node -> occurrences of its substring
    children: list[dict[int, int] | None] = field(default_factory=lambda: [None])  # node -> token -> node
    last_end: list[int] = field(default_factory=lambda: [0])  # node -> its latest occurrence (POSITION_BITS)
    free: list[int] = field(default_factory=list)  # ids of removed nodes, for reuse
    num_nodes: int = 0  # nodes in use, the root excluded

    @property
    def nbytes(self) -> int:
        return self.num_nodes * NODE_BYTES

    # ---- building ----------------------------------------------------------------------------------
    def extend(
        self, tokens: Sequence[int], text_id: int = 0, start: int = 0, open_nodes: list[int] | None = None
    ) -> list[int]:
        """Append tokens[...] to text `text_id`, whose first `start` tokens were fed before and left
        `open_nodes` (what that call returned; None for a new text). Returns the nodes of the text's
        suffixes now, longest last, for the next call."""
        counts, children, last_end, limit = self.counts, self.children, self.last_end, self.depth - 1
        nodes = open_nodes or []
        position = (text_id << POSITION_BITS) + start
        for token in tokens:
            grown = []
            for parent in [0] + nodes[:limit]:
                kids = children[parent]
                if kids is None:
                    kids = children[parent] = {}
                node = kids.get(token)
                if node is None:
                    node = kids[token] = self._new_node()
                counts[node] += 1
                last_end[node] = position
                grown.append(node)
            nodes = grown
            position += 1
        return nodes

    def remove(self, tokens: Sequence[int]) -> None:
        """Forget one earlier extension by a whole text. A node whose count drops to 0 occurred only there,
        and so did everything below it: it is unlinked at once and freed once the replay, which still
        walks through it, is done."""
        counts, children, limit = self.counts, self.children, self.depth - 1
        nodes: list[int] = []
        dead: list[int] = []
        for token in tokens:
            grown = []
            for parent in [0] + nodes[:limit]:
                kids = children[parent]
                node = kids[token]
                counts[node] -= 1
                if counts[node] == 0:
                    del kids[token]
                    if not kids:
                        children[parent] = None
                    dead.append(node)
                grown.append(node)
            nodes = grown
        for node in dead:
            children[node] = None
        self.free += dead
        self.num_nodes -= len(dead)

    def _new_node(self) -> int:
        self.num_nodes += 1
        if self.free:
            node = self.free.pop()
            self.counts[node] = 0
            return node
        self.counts.append(0)
        self.children.append(None)
        self.last_end.append(0)
        return len(self.counts) - 1

    # ---- drafting ----------------------------------------------------------------------------------
    def longest_continued(self, context: Sequence[int]) -> tuple[int, int]:
        """(node, length) of the longest suffix of `context` indexed with a continuation ((0, 0): none)."""
        suffixes = (self._find(context, len(context) - m) for m in range(1, min(self.depth - 1, len(context)) + 1))
        return self._longest_continued(suffixes)

    def longest_continued_in(self, open_nodes: list[int]) -> tuple[int, int]:
        """The same for a text fed to this trie, from the suffix nodes its last extend() returned."""
        return self._longest_continued(iter(open_nodes[: self.depth - 1]))

    def _longest_continued(self, suffix_nodes) -> tuple[int, int]:
        """suffix_nodes: the context's suffixes' nodes (None where not indexed), shortest first."""
        best = (0, 0)
        for match, node in enumerate(suffix_nodes, 1):
            if node is None or self.children[node] is None:
                break  # a longer suffix ends with this one, so it has no continuation either
            best = (node, match)
        return best

    def _find(self, context: Sequence[int], start: int) -> int | None:
        node, children = 0, self.children
        for i in range(start, len(context)):
            kids = children[node]
            node = kids.get(context[i]) if kids is not None else None
            if node is None:
                return None
        return node

    def draft_from(
        self, node: int, match: int, max_tokens: int, min_prob: float, text: Callable[[int], Sequence[int] | None]
    ) -> Draft:
        """Up to max_tokens continuing the context suffix at `node`; text(id) gives a text to copy from."""
        draft, p = Draft(match=match), 1.0
        counts, children = self.counts, self.children
        while len(draft.tokens) < max_tokens:
            kids = children[node]
            if kids is None:
                break
            total = 0
            for child in kids.values():
                total += counts[child]
            token, child = max(kids.items(), key=lambda item: counts[item[1]])
            q = counts[child] / total
            if p * q < min_prob:
                break
            p *= q
            draft.tokens.append(token)
            draft.probs.append(q)
            node = child
            if counts[child] == 1 or children[child] is None:  # one occurrence, or the trie's depth: what
                self._copy_after(child, max_tokens, draft, text)  # followed the latest is the evidence left
                break
        return draft

    def _copy_after(self, node: int, max_tokens: int, draft: Draft, text: Callable) -> None:
        text_id, end = divmod(self.last_end[node], 1 << POSITION_BITS)
        tokens = text(text_id)
        if tokens is None:
            return
        copied = list(tokens[end + 1 : end + 1 + max_tokens - len(draft.tokens)])
        draft.tokens += copied
        draft.probs += [1.0] * len(copied)
        draft.source = text_id
