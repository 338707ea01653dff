"""A depth-limited suffix trie with occurrence counts: every substring of up to `depth` tokens of the texts
fed to it occurred `count` times and last ended at `last_end`. A substring that occurred once says nothing its
text does not, so the trie makes nodes only where counts branch: below a node that occurred once, the text after
that occurrence stands for the subtree (an implicit path), and the node gets its child when it occurs again.
Code and prose then hold one or two nodes a token rather than one per suffix, and appending a token touches
only the suffixes ending there that occurred before, so a sequence is indexed as it grows, never rebuilt.
Removing a text replays its insertion with counts going down, which is how a bounded cache of earlier outputs
forgets one.

A draft continues the longest suffix of the context that occurred before with a continuation: it follows
the most frequent child while the product of the branch frequencies (how often that continuation
followed this context) stays above `min_prob`. Once the path has occurred only once, its continuation is
the text after that occurrence, copied up to the length asked for: the trie's depth bounds the context
it matches on, not how far a draft reaches."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

# Bytes per trie node on CPython 3.11 (its list entries, its count and position, its share of child maps),
# measured by tests/test_suffix.py: what a cache's byte cap counts.
NODE_BYTES = 270
POSITION_BITS = 32  # a node's last occurrence: text id << POSITION_BITS | index of its last token
POSITION_MASK = (1 << POSITION_BITS) - 1

Texts = Callable[[int], Sequence[int] | None]  # a text id -> its tokens (None: forgotten)
Spot = tuple[int, int]  # where a substring ends: (node, tokens past it along its only occurrence's text)


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
        self,
        tokens: Sequence[int],
        text: Texts,
        text_id: int = 0,
        start: int = 0,
        open_nodes: list[int] | None = None,
    ) -> list[int]:
        """Append tokens[...] to text `text_id`, whose first `start` tokens were fed before and left
        `open_nodes` (what that call returned; None for a new text). text(id) reads this text and earlier ones.
        Returns the nodes of the text's suffixes now, longest last, for the next call. A text is fed whole before
        the next one starts, and an id is never given to another text: a node's first occurrence is read back."""
        counts, children, last_end, limit = self.counts, self.children, self.last_end, self.depth - 1
        nodes = open_nodes or []
        position = (text_id << POSITION_BITS) + start
        for token in tokens:
            grown = []
            for length, parent in enumerate([0] + nodes[:limit]):
                if parent and counts[parent] < 2:
                    break  # it occurred only where it ends now: what follows it is in the text (longer ones too)
                kids = children[parent]
                if kids is None:
                    kids = children[parent] = {}
                node = kids.get(token)
                if node is None:
                    node = kids[token] = self._new_node()
                elif counts[node] == 1 and children[node] is None and length + 1 < self.depth:
                    self._unfold(node, position, text)
                counts[node] += 1
                last_end[node] = position
                grown.append(node)
            nodes = grown
            position += 1
        return nodes

    def _unfold(self, node: int, now: int, text: Texts) -> None:
        """A node about to occur a second time gets the child its first occurrence continues with, unless that
        continuation ends `now`: the caller adds that one as the next longer suffix."""
        follows = self.last_end[node] + 1
        if follows == now:
            return
        tokens, index = text(follows >> POSITION_BITS), follows & POSITION_MASK
        if tokens is None or index >= len(tokens):
            return
        self.children[node] = {tokens[index]: self._new_node(1, follows)}

    def remove(self, tokens: Sequence[int]) -> None:
        """Forget one earlier extension by a whole text. A node whose count drops to 0 occurred only there,
        and so did everything below it: it is unlinked at once and freed once the replay, which still
        walks through it, is done. A node left with one occurrence keeps its children (their counts stay
        exact). `last_end` may still name the forgotten text, as a trie of every substring's would: a copy from
        there stops, and a node without children that names it has nothing after its occurrence left."""
        counts, children, limit = self.counts, self.children, self.depth - 1
        nodes: list[int] = []
        dead: list[int] = []
        for token in tokens:
            grown = []
            for parent in [0] + nodes[:limit]:
                kids = children[parent]
                node = kids.get(token) if kids is not None else None
                if node is None:
                    break  # an implicit path: this text's only occurrence, no node to count down
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

    def _new_node(self, count: int = 0, last_end: int = 0) -> int:
        self.num_nodes += 1
        if self.free:
            node = self.free.pop()
            self.counts[node], self.last_end[node] = count, last_end
            return node
        self.counts.append(count)
        self.children.append(None)
        self.last_end.append(last_end)
        return len(self.counts) - 1

    # ---- reading -----------------------------------------------------------------------------------
    def occurrences(self, substring: Sequence[int], text: Texts) -> int:
        """How often `substring` (at most depth tokens) occurred in the texts fed."""
        spot = self._find(substring, 0, text)
        return 0 if spot is None else self.counts[spot[0]]

    def longest_continued(self, context: Sequence[int], text: Texts) -> tuple[Spot, int]:
        """(spot, length) of the longest suffix of `context` that occurred with a continuation (length 0: none)."""
        suffixes = (
            self._find(context, len(context) - m, text) for m in range(1, min(self.depth - 1, len(context)) + 1)
        )
        return self._longest_continued(suffixes, text)

    def longest_continued_in(self, open_nodes: list[int], text: Texts) -> tuple[Spot, int]:
        """The same for a text fed to this trie, from the suffix nodes its last extend() returned."""
        return self._longest_continued(((node, 0) for node in open_nodes[: self.depth - 1]), text)

    def _longest_continued(self, suffixes: Iterable[Spot | None], text: Texts) -> tuple[Spot, int]:
        """suffixes: the context's suffixes' spots (None where they never occurred), shortest first."""
        best = ((0, 0), 0)
        for match, spot in enumerate(suffixes, 1):
            if spot is None or not self._continues(spot, text):
                break  # a longer suffix ends with this one, so it has no continuation either
            best = (spot, match)
        return best

    def _find(self, context: Sequence[int], start: int, text: Texts) -> Spot | None:
        node, children = 0, self.children
        for i in range(start, len(context)):
            kids = children[node]
            child = kids.get(context[i]) if kids is not None else None
            if child is None:
                return self._read_on(node, context[i:], text) if self._implicit_below(node) else None
            node = child
        return node, 0

    def _implicit_below(self, node: int) -> bool:
        return node != 0 and self.counts[node] == 1 and self.children[node] is None

    def _read_on(self, node: int, tokens: Sequence[int], text: Texts) -> Spot | None:
        """Where `tokens` end if they follow the node's only occurrence in its text."""
        following = self._following(node, 0, len(tokens), text)
        return (node, len(tokens)) if following == list(tokens) else None

    def _following(self, node: int, past: int, n: int, text: Texts) -> list[int] | None:
        """Up to n tokens of the text after the node's latest occurrence and `past` tokens beyond it (None: that
        text is forgotten)."""
        text_id, end = divmod(self.last_end[node], 1 << POSITION_BITS)
        tokens = text(text_id)
        start = end + 1 + past
        return None if tokens is None else list(tokens[start : start + n])

    def _continues(self, spot: Spot, text: Texts) -> bool:
        node, past = spot
        if past or self._implicit_below(node):
            return bool(self._following(node, past, 1, text))
        return self.children[node] is not None

    def draft_from(self, spot: Spot, match: int, max_tokens: int, min_prob: float, text: Texts) -> Draft:
        """Up to max_tokens continuing the context suffix at `spot`; text(id) gives a text to copy from."""
        draft, p = Draft(match=match), 1.0
        node, past = spot
        if max_tokens <= 0:
            return draft
        if past or self._implicit_below(node):
            self._copy_after(node, past, max_tokens, draft, text)
            return draft
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
                self._copy_after(child, 0, max_tokens, draft, text)  # followed the latest is the evidence left
                break
        return draft

    def _copy_after(self, node: int, past: int, max_tokens: int, draft: Draft, text: Texts) -> None:
        copied = self._following(node, past, max_tokens - len(draft.tokens), text)
        if copied is None:
            return
        draft.tokens += copied
        draft.probs += [1.0] * len(copied)
        draft.source = self.last_end[node] >> POSITION_BITS
