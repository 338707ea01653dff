"""Suffix speculation: long drafts that cost no forward, continued from the sequence's own text (a code edit
copies its prompt) and from earlier outputs (an agent loop rewrites the same file, tool call and JSON).

Each sequence indexes its prompt and output in a suffix trie of its own as tokens are committed; finished
outputs go to a cache of tries partitioned by tenant (the server's API key and `user`), so that one
tenant's outputs never shape another's drafts: whether a draft is accepted changes how fast tokens
arrive, which would leak what someone else generated. The cache has one byte cap over all tenants and
evicts the least recently used output (added, or drafted from). Drafts are deterministic (q is one-hot),
so verification keeps the target's distribution exactly, as for prompt lookup."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

from ..config import SUFFIX_SCOPES
from .base import DraftBatch, Preview, Proposer
from .catch_up import catch_up, share
from .registry import ProposerSetup
from .suffix_tree import NODE_BYTES, Draft, SuffixTrie

TOKEN_BYTES = 4  # a stored token id (texts are kept as arrays of int32)


@dataclass
class _Unindexed:
    """An output in the cache not yet wholly in its trie."""

    indexed: int = 0  # its tokens fed to the trie so far
    open_nodes: list[int] | None = None  # what the trie returned for them


class SuffixCache:
    """Earlier outputs, one trie per scope key, under one byte cap with least-recently-used eviction.
    scope "tenant": the key is the request's tenant; "global": everyone shares one (a single-user
    deployment); "none": nothing is kept across requests. An output added is indexed by later calls of
    `index`, a bounded number of tokens each, so that a long one finishing never stalls the step it ends in
    (until then, a draft whose match ends in its indexed part may copy on into the rest)."""

    def __init__(self, max_bytes: int, scope: str = "tenant", depth: int = 24):
        if scope not in SUFFIX_SCOPES:
            raise ValueError(f"unknown suffix cache scope {scope!r}; use one of {', '.join(SUFFIX_SCOPES)}")
        self.max_bytes, self.scope, self.depth = max_bytes, scope, depth
        self.tries: dict[str, SuffixTrie] = {}
        self.texts: OrderedDict[int, tuple[str, array]] = OrderedDict()  # id -> (key, tokens), LRU first
        self._unindexed: OrderedDict[int, _Unindexed] = OrderedDict()  # by text id, oldest first
        self._ids = count(1)  # never reused (the tries read texts back by id); 0 is a sequence's own text
        self._bytes = 0
        self.unindexed_tokens = 0

    def key(self, tenant: str) -> str | None:
        return None if self.scope == "none" else tenant if self.scope == "tenant" else ""

    @property
    def nbytes(self) -> int:
        """The tries' nodes and the texts they copy from (kept as a running total: read every step)."""
        return self._bytes

    def add(self, tenant: str, tokens: list[int]) -> None:
        """Keep an output to draft from once `index` has fed it to its tenant's trie."""
        key = self.key(tenant)
        if key is None or not tokens:
            return
        text_id = next(self._ids)
        self.texts[text_id] = key, array("i", tokens)
        self._unindexed[text_id] = _Unindexed()
        self.unindexed_tokens += len(tokens)
        self._bytes += TOKEN_BYTES * len(tokens)
        self._keep_under_cap()

    def index(self, max_tokens: int | None = None) -> None:
        """Feed up to max_tokens (None: all) of the outputs added and not yet indexed to their tries, oldest first."""
        budget = self.unindexed_tokens if max_tokens is None else max_tokens
        while self._unindexed and budget > 0:
            text_id, progress = next(iter(self._unindexed.items()))
            key, tokens = self.texts[text_id]
            piece = tokens[progress.indexed : progress.indexed + budget]
            trie = self.tries.setdefault(key, SuffixTrie(self.depth))
            before = trie.nbytes
            progress.open_nodes = trie.extend(piece, self._text, text_id, progress.indexed, progress.open_nodes)
            self._bytes += trie.nbytes - before
            progress.indexed += len(piece)
            budget -= len(piece)
            self.unindexed_tokens -= len(piece)
            if progress.indexed == len(tokens):
                del self._unindexed[text_id]
        self._keep_under_cap()

    def _keep_under_cap(self) -> None:
        while self.texts and self.nbytes > self.max_bytes:
            self._evict(next(iter(self.texts)))

    def _evict(self, text_id: int) -> None:
        key, tokens = self.texts.pop(text_id)
        progress = self._unindexed.pop(text_id, None)
        indexed = len(tokens) if progress is None else progress.indexed
        self.unindexed_tokens -= len(tokens) - indexed
        self._bytes -= TOKEN_BYTES * len(tokens)
        if indexed:
            trie = self.tries[key]
            before = trie.nbytes
            trie.remove(tokens[:indexed])
            self._bytes -= before - trie.nbytes
            if not trie.num_nodes:
                del self.tries[key]

    def draft(self, tenant: str, context: list[int], max_tokens: int | Callable[[int], int], min_prob: float) -> Draft:
        """max_tokens: a number, or the number for a context match of a given length."""
        key = self.key(tenant)
        trie = self.tries.get(key) if key is not None else None
        if trie is None:
            return Draft()
        spot, match = trie.longest_continued(context, self._text)
        if not match:
            return Draft()
        limit = max_tokens(match) if callable(max_tokens) else max_tokens
        draft = trie.draft_from(spot, match, limit, min_prob, self._text)
        if draft.source in self.texts:
            self.texts.move_to_end(draft.source)  # drafted from: recently used
        return draft

    def _text(self, text_id: int) -> array | None:
        entry = self.texts.get(text_id)
        return entry[1] if entry else None

    def tenant_texts(self, tenant: str) -> list[list[int]]:
        """The outputs a tenant's drafts may come from."""
        key = self.key(tenant)
        return [list(tokens) for k, tokens in self.texts.values() if k == key]


@dataclass
class _Local:
    """A sequence's own text and its trie, indexed from the start. Until all of it has been (a long prompt's first
    steps), drafts match its end by walking the trie from the root, finding what the part indexed holds."""

    trie: SuffixTrie
    tokens: list[int]  # the sequence's prompt and output: one list, grown in place
    indexed: int = 0  # tokens of it fed to the trie
    open_nodes: list[int] = field(default_factory=list)  # the nodes of the indexed part's suffixes
    caught_up: bool = False  # indexed whole once: from then on a step's few new tokens are indexed as they come

    @property
    def behind(self) -> int:
        return len(self.tokens) - self.indexed

    def index(self, max_tokens: int) -> None:
        piece = self.tokens[self.indexed : self.indexed + max_tokens]
        self.open_nodes = self.trie.extend(piece, self.text, 0, self.indexed, self.open_nodes)
        self.indexed += len(piece)
        self.caught_up = self.caught_up or not self.behind

    def text(self, _text_id: int) -> list[int]:
        return self.tokens


class SuffixProposer(Proposer):
    """max_tokens: the longest draft; min_prob: a draft stops where its frequency estimate (the product of
    how often each of its tokens followed the one before) would fall below this; depth: the longest
    context matched; match_factor: a draft is at most this many times as long as the context match
    behind it. A text seen once says nothing about how far a copy stays right, but a long match does:
    without this bound a one-token match would copy 32 tokens that are rarely all right."""

    previews = True

    def __init__(
        self,
        max_tokens: int = 32,
        min_prob: float = 0.1,
        depth: int = 24,
        match_factor: float = 2.0,
        cache: SuffixCache | None = None,
    ):
        if max_tokens < 1 or depth < 2 or not 0 <= min_prob <= 1 or match_factor <= 0:
            raise ValueError(
                "suffix speculation needs max_tokens >= 1, depth >= 2, 0 <= min_prob <= 1 and match_factor > 0"
            )
        self.max_draft, self.min_prob, self.depth, self.match_factor = max_tokens, min_prob, depth, match_factor
        self.host_bytes_per_token = depth * NODE_BYTES  # a sequence's own trie: at most a node a token and depth
        self.cache = cache or SuffixCache(0, "none", depth)
        if self.cache.depth != depth:
            raise ValueError(f"the cache indexes {self.cache.depth} tokens deep and the proposer {depth}")
        self._local: dict[int, _Local] = {}  # by KV slot

    @classmethod
    def from_setup(cls, setup: ProposerSetup) -> "SuffixProposer":
        c = setup.config
        return cls(
            c.suffix_max_tokens, c.suffix_min_prob, cache=SuffixCache(c.suffix_cache_bytes, c.suffix_cache_scope)
        )

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def forget_prefixes(self) -> None:
        self.cache = SuffixCache(self.cache.max_bytes, self.cache.scope, self.depth)  # no earlier output drafts now

    def preview(self, seqs, k: int) -> list[Preview]:
        self._catch_up(seqs)
        previews = []
        for seq in seqs:
            draft = self.draft(seq, min(k, self.max_draft))
            previews.append(Preview(draft.match, draft.tokens, draft.probs))
        return previews

    def propose(self, seqs, ks, feedback=None) -> DraftBatch:
        self._catch_up(seqs)
        return DraftBatch([self.draft(s, k).tokens if k > 0 else [] for s, k in zip(seqs, ks)], [None] * len(seqs))

    def _catch_up(self, seqs) -> None:
        """Index a bounded share of what waits: the cache's finished outputs, then the sequences' own texts."""
        self.cache.index(share(self.cache.unindexed_tokens))
        catch_up(map(self._local_of, seqs))

    def draft(self, seq, max_tokens: int) -> Draft:
        """The better-supported of the drafts from the sequence's own text and from the tenant's cache, as far as
        they are indexed (`_catch_up`)."""
        local, ids = self._local_of(seq), seq.token_ids
        if local.behind:
            spot, match = local.trie.longest_continued(ids, local.text)
        else:
            spot, match = local.trie.longest_continued_in(local.open_nodes, local.text)  # its suffixes' nodes: no walk
        own = (
            local.trie.draft_from(spot, match, self._limit(match, max_tokens), self.min_prob, local.text)
            if match
            else Draft()
        )
        cached = self.cache.draft(seq.tenant, ids, lambda m: self._limit(m, max_tokens), self.min_prob)
        better = (cached.expected_tokens, cached.match) > (own.expected_tokens, own.match)  # ties: the longer match
        return cached if better else own

    def _limit(self, match: int, max_tokens: int) -> int:
        return min(max_tokens, int(self.match_factor * match))

    def _local_of(self, seq) -> _Local:
        local = self._local.get(seq.slot)
        if local is None or local.tokens is not seq.token_ids:
            local = self._local[seq.slot] = _Local(SuffixTrie(self.depth), seq.token_ids)
        return local

    def suspend(self, seq) -> None:
        self._local.pop(seq.slot, None)  # its output is not finished: not yet one to draft from

    def release(self, seq) -> None:
        self._local.pop(seq.slot, None)
        if seq.finish_reason != "abort":
            self.cache.add(seq.tenant, seq.output_ids)
