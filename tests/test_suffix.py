"""Suffix speculation: the trie counts what a brute-force count says and forgets a text exactly; drafts copy
what followed a match and stop where the counts disagree; the cross-request cache never lets one tenant
draft from another's outputs and stays under its byte cap; in the engine, greedy output equals plain
decoding and sampled outputs follow the target's distribution (and accepting drafts unverified fails
both checks)."""

import random
import tracemalloc

import pytest
from conftest import priced_without_timing, run_as_one_batch, tiny_model
from stats import PASS_P, SEED, chi2_pvalue, exact_joint, sampled_joint
from suffix_reference import FullTrie

from specdecode import LLM, SamplingParams
from specdecode.proposers.catch_up import BACKLOG_SHARE, INDEX_TOKENS
from specdecode.proposers.suffix import SuffixCache, SuffixProposer
from specdecode.proposers.suffix_tree import NODE_BYTES, POSITION_BITS, SuffixTrie

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _substring_counts(texts, depth):
    counts = {}
    for text in texts:
        for i in range(len(text)):
            for j in range(i + 1, min(len(text), i + depth) + 1):
                counts[tuple(text[i:j])] = counts.get(tuple(text[i:j]), 0) + 1
    return counts


def _trie_counts(trie):
    """The counts of the substrings the trie holds nodes for."""
    counts, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in (trie.children[node] or {}).items():
            counts[path + (token,)] = trie.counts[child]
            stack.append((child, path + (token,)))
    return counts


def _branching(counts):
    """What the trie must hold nodes for: single tokens, and each extension of a substring that occurred twice."""
    return {s: n for s, n in counts.items() if len(s) == 1 or counts[s[:-1]] > 1}


def _fed(texts, depth, piece=7):
    """A trie fed each text in pieces, as a sequence grows, and what reads the texts by id."""
    trie, read = SuffixTrie(depth), dict(enumerate(texts)).get
    for text_id, text in enumerate(texts):
        nodes = None
        for start in range(0, len(text), piece):
            nodes = trie.extend(text[start : start + piece], read, text_id, start, nodes)
    return trie, read


def _random_texts(seed):
    rng = random.Random(seed)
    repetitive = [[rng.randrange(4) for _ in range(rng.randrange(1, 60))] for _ in range(4)]
    return repetitive + [[rng.randrange(1000) for _ in range(80)] * 2]  # a long span written twice


def _miscounts(trie, read, texts, depth):
    """Substrings (and some that never occurred) whose count the trie misreports."""
    counts = _substring_counts(texts, depth)
    absent = [s[:-1] + (-1,) for s in counts]
    return {s: trie.occurrences(s, read) for s in [*counts, *absent] if trie.occurrences(s, read) != counts.get(s, 0)}


def _counts_after_removals(trie, read, texts, depth):
    """Every count right, and nodes where counts branch; a node left with one occurrence may keep its children."""
    counts, held = _substring_counts(texts, depth), _trie_counts(trie)
    return not _miscounts(trie, read, texts, depth) and _branching(counts).items() <= held.items() <= counts.items()


# ---- the trie -----------------------------------------------------------------------------------------
def test_trie_counts_every_substring_up_to_its_depth_with_nodes_only_where_counts_branch():
    texts = _random_texts(SEED)
    trie, read = _fed(texts, 6)
    assert not _miscounts(trie, read, texts, 6)
    assert _trie_counts(trie) == _branching(_substring_counts(texts, 6))


def _unfold_always(self, node, now, text):
    """Broken: the first occurrence's continuation made a node even where it is the one being added."""
    follows = self.last_end[node] + 1
    text_id, index = divmod(follows, 1 << POSITION_BITS)
    if index < len(text(text_id)):
        self.children[node] = {text(text_id)[index]: self._new_node(1, follows)}


@pytest.mark.parametrize("broken", [lambda self, node, now, text: None, _unfold_always], ids=["never", "always"])
def test_a_trie_that_unfolds_a_second_occurrence_wrongly_miscounts(monkeypatch, broken):
    """The check above can fail: without a node for the first occurrence's continuation, or with one also where
    the caller adds it, counts come out wrong."""
    monkeypatch.setattr(SuffixTrie, "_unfold", broken)
    texts = _random_texts(SEED)
    assert _miscounts(*_fed(texts, 6), texts, 6)


def test_removing_a_text_leaves_what_the_others_alone_would_count():
    texts = _random_texts(SEED + 1)
    trie, read = _fed(texts, 5)
    for gone in (1, 4, 0):
        trie.remove(texts[gone])
        kept = {i: t for i, t in enumerate(texts) if read(i) is not None and i != gone}
        read = kept.get
        assert _counts_after_removals(trie, read, list(kept.values()), 5)
    for text_id in kept:
        trie.remove(texts[text_id])
    assert trie.num_nodes == 0 and trie.children[0] is None
    trie.extend(texts[1], {7: texts[1]}.get, 7)  # freed nodes are reused
    assert _trie_counts(trie) == _branching(_substring_counts([texts[1]], 5))


def _bytes_per_node(text):
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie = SuffixTrie(depth=16)
    trie.extend(text, lambda _: text)
    measured = (tracemalloc.get_traced_memory()[0] - before) / trie.num_nodes
    tracemalloc.stop()
    return measured


def test_node_bytes_is_what_a_node_costs_at_most():
    rng = random.Random(SEED)
    span = [rng.randrange(150_000) for _ in range(1000)]
    written_twice = _bytes_per_node(span + span)  # chains of nodes with a child each: the costliest per node
    assert 0.8 * NODE_BYTES < written_twice < 1.05 * NODE_BYTES
    assert _bytes_per_node([rng.randrange(8) for _ in range(4000)]) < NODE_BYTES  # a mix of leaves and branches


def test_a_draft_copies_what_followed_the_longest_match_beyond_the_trie_depth():
    span = list(range(10, 60))
    text = [1, 2] + span + [3, 4, 5] + span[:6]  # the span is being written again
    read = {0: text}.get
    trie = SuffixTrie(depth=8)
    open_nodes = trie.extend(text, read)
    spot, match = trie.longest_continued(text, read)
    assert trie.longest_continued_in(open_nodes, read) == (spot, match)  # the text's own suffix nodes, no walk
    draft = trie.draft_from(spot, match, 32, 0.1, read)
    assert match == 6 and draft.tokens == span[6:38] and draft.probs == [1.0] * 32


def test_draft_length_follows_how_often_the_continuation_followed():
    """After '0 7 8' came 9 twice and 5 once, so a draft of 9 is right with p = 2/3; '0 7 8 9' was followed
    by 2 both times (p = 1). A draft goes on while the product stays above min_prob."""
    text = [7, 8, 9, 1, 0, 7, 8, 9, 2, 0, 7, 8, 9, 2, 0, 7, 8, 5, 0, 7, 8]
    read = {0: text}.get
    trie = SuffixTrie(depth=8)
    trie.extend(text, read)
    spot, match = trie.longest_continued(text, read)
    assert match == 3  # '0 7 8': '5 0 7 8' never occurred before
    assert trie.draft_from(spot, match, 10, 0.7, read).tokens == []
    loose = trie.draft_from(spot, match, 10, 0.5, read)
    assert loose.tokens[:2] == [9, 2] and loose.probs[:2] == pytest.approx([2 / 3, 1.0])


def _compare(trie, full, read, context, own, differences):
    """Record where the trie's longest match or its drafts from there differ from the full trie's."""
    spot, match = trie.longest_continued_in(own, read) if own is not None else trie.longest_continued(context, read)
    node, expected = full.longest_continued(context)
    if match != expected:
        differences.append((context, match, expected))
        return
    for max_tokens, min_prob in [(1, 0.0), (6, 0.3), (40, 0.1), (40, 0.8)] * bool(match):
        ours, theirs = (t.draft_from(s, match, max_tokens, min_prob, read) for t, s in ((trie, spot), (full, node)))
        if (ours.tokens, ours.probs, ours.source) != (theirs.tokens, theirs.probs, theirs.source):
            differences.append((context, max_tokens, min_prob, ours, theirs))


def _own_text_differences(rng, depth, vocab, differences):
    """One sequence's own trie, fed as it grows, drafting from its end."""
    text, trie, full, own, full_own = [], SuffixTrie(depth), FullTrie(depth), None, None
    read = {0: text}.get  # the text as it grows (in place)
    while len(text) < 150:
        piece = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
        start = len(text)
        text += piece
        own = trie.extend(piece, read, 0, start, own)
        full_own = full.extend(piece, 0, start, full_own)
        _compare(trie, full, read, text, own, differences)


def _cache_differences(rng, depth, vocab, differences):
    """A cache's trie: texts fed in pieces, others forgotten between pieces; contexts from what is left once a text
    is whole (matching implicit paths, branching ones and none)."""
    live, trie, full = {}, SuffixTrie(depth), FullTrie(depth)
    for text_id in range(1, 9):
        live[text_id] = text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        cuts = sorted({0, len(text), *(rng.randrange(len(text)) for _ in range(2))})
        nodes = full_nodes = None
        for start, end in zip(cuts, cuts[1:]):
            nodes = trie.extend(text[start:end], live.get, text_id, start, nodes)
            full_nodes = full.extend(text[start:end], text_id, start, full_nodes)
            if rng.random() < 0.3 and len(live) > 1:
                gone = rng.choice([i for i in live if i != text_id])
                trie.remove(live[gone])
                full.remove(live.pop(gone))
        for _ in range(6):  # a text fed in part drafts past its fed part, where the full trie has nothing: not here
            source = rng.choice(list(live.values()))
            cut = rng.randrange(len(source) + 1)
            context = source[max(0, cut - rng.randrange(1, 30)) : cut]
            context += [rng.randrange(vocab) for _ in range(rng.randrange(3))]
            _compare(trie, full, live.get, context, None, differences)


def _draft_differences(seed, trials=40):
    """Drafts (tokens, probabilities, source) that differ from those of a trie with every substring a node."""
    rng, differences = random.Random(seed), []
    for _ in range(trials):
        depth, vocab = rng.choice([3, 5, 8, 24]), rng.choice([3, 8, 50])
        _own_text_differences(rng, depth, vocab, differences)
        _cache_differences(rng, depth, vocab, differences)
    return differences


def test_drafts_are_those_of_a_trie_with_every_substring_a_node():
    assert not _draft_differences(SEED)


def test_a_trie_that_does_not_read_implicit_paths_drafts_differently(monkeypatch):
    """The check above can fail: a node that occurred once is taken for one with nothing after it."""
    monkeypatch.setattr(SuffixTrie, "_implicit_below", lambda self, node: False)
    assert _draft_differences(SEED)


# ---- the cache --------------------------------------------------------------------------------------------
def test_one_tenants_outputs_never_appear_in_another_tenants_drafts():
    rng = random.Random(SEED)
    cache = SuffixCache(1 << 30, "tenant")
    secrets = {
        t: [[rng.randrange(low, low + 500) for _ in range(50)] for _ in range(5)]
        for t, low in (("alice", 0), ("bob", 500))
    }
    for tenant, outputs in secrets.items():
        for output in outputs:
            cache.add(tenant, output)
    cache.index()
    for output in secrets["alice"]:
        context = output[:20]
        assert cache.draft("alice", context, 32, 0.1).tokens == output[20:50][:30]
        assert cache.draft("bob", context, 32, 0.1).tokens == []  # bob never sees alice's text
        assert cache.draft("mallory", context, 32, 0.1).tokens == []
    assert cache.tenant_texts("bob") == secrets["bob"]
    shared = SuffixCache(1 << 30, "global")  # the check above can fail: a shared cache leaks
    shared.add("alice", secrets["alice"][0])
    shared.index()
    assert shared.draft("bob", secrets["alice"][0][:20], 32, 0.1).tokens


def test_the_cache_stays_under_its_byte_cap_and_evicts_the_least_recently_used():
    rng = random.Random(SEED)
    outputs = [[rng.randrange(10**6) for _ in range(100)] for _ in range(20)]  # no token shared: alike in size
    one = SuffixCache(1 << 30)
    one.add("t", outputs[0])
    one.index()
    cap = int(one.nbytes * 5.5)  # room for five outputs
    cache = SuffixCache(cap)
    for i, output in enumerate(outputs):
        cache.add("t", output)
        cache.index()
        assert cache.nbytes <= cap
        if i == 2:
            assert cache.draft("t", outputs[0][:30], 32, 0.1).tokens  # the oldest, used: kept
    kept = cache.tenant_texts("t")
    assert len(kept) == 5 and outputs[0] not in kept and kept == outputs[-5:]  # FIFO until used again...
    lru = SuffixCache(cap)
    for output in outputs[:8]:
        lru.add("t", output)
        lru.index()
        assert lru.draft("t", outputs[0][:30], 32, 0.1).tokens  # ... and kept while drafted from
    assert outputs[0] in lru.tenant_texts("t") and outputs[1] not in lru.tenant_texts("t")
    for _ in lru.tenant_texts("t"):
        lru._evict(next(iter(lru.texts)))
    assert lru.nbytes == 0 and not lru.tries


def _indexed_in_pieces(texts, piece):
    cache = SuffixCache(1 << 30, "global", depth=6)
    for text in texts:
        cache.add("t", text)
    while cache._unindexed:
        cache.index(piece)
    return cache


def _resuming_nowhere(extend):
    def broken(self, tokens, text, text_id=0, start=0, open_nodes=None):
        return extend(self, tokens, text, text_id, start)  # each piece taken for a text's start

    return broken


@pytest.mark.parametrize("broken", [False, True])
def test_outputs_indexed_a_few_tokens_a_step_count_as_if_indexed_at_once(monkeypatch, broken):
    texts = _random_texts(SEED + 2)
    whole = _indexed_in_pieces(texts, 10_000)
    if broken:  # the check can fail: pieces that do not carry on where the last one stopped miscount
        monkeypatch.setattr(SuffixTrie, "extend", _resuming_nowhere(SuffixTrie.extend))
    pieces = _indexed_in_pieces(texts, 7)
    same = _trie_counts(pieces.tries[""]) == _trie_counts(whole.tries[""]) and pieces.nbytes == whole.nbytes
    assert same != broken


def test_an_output_forgotten_half_indexed_leaves_what_the_others_alone_would_count():
    texts = _random_texts(SEED + 3)
    cache = SuffixCache(1 << 30, "global", depth=6)
    for text in texts:
        cache.add("t", text)
    cache.index(len(texts[0]) + len(texts[1]) // 2)  # the first output whole, the second in part
    cache._evict(2)
    assert _counts_after_removals(cache.tries[""], cache._text, texts[:1], 6)
    cache._evict(1)
    assert not cache.tries  # nothing indexed is left
    cache.index()
    assert _trie_counts(cache.tries[""]) == _branching(_substring_counts(texts[2:], 6))
    assert cache.nbytes == _indexed_in_pieces(texts[2:], 10_000).nbytes


def test_a_step_indexes_a_bounded_part_of_a_long_output():
    from types import SimpleNamespace

    proposer = SuffixProposer(cache=SuffixCache(1 << 30, "global"))
    proposer.cache.add("t", list(range(1000)))
    seq = SimpleNamespace(slot=0, tenant="t", token_ids=[1, 2, 3])
    proposer.preview([seq], 4)
    assert proposer.cache._unindexed[1].indexed == INDEX_TOKENS < 1000
    proposer.propose([seq], [4])
    assert proposer.cache._unindexed[1].indexed == 2 * INDEX_TOKENS
    for _ in range(16):  # outputs finishing faster than that: an eighth of the backlog a call
        proposer.cache.add("t", list(range(1000)))
    backlog = proposer.cache.unindexed_tokens
    proposer.preview([seq], 4)
    assert proposer.cache.unindexed_tokens == backlog - backlog // BACKLOG_SHARE


# ---- a sequence's own text ---------------------------------------------------------------------------------
def _growing_sequence(prompt, slot=0):
    from types import SimpleNamespace

    return SimpleNamespace(slot=slot, tenant="t", token_ids=list(prompt))


@pytest.mark.parametrize("broken", [False, True])
def test_a_long_prompt_is_indexed_in_bounded_pieces_that_count_as_if_indexed_at_once(monkeypatch, broken):
    if broken:  # the check can fail: pieces that do not carry on where the last one stopped miscount
        monkeypatch.setattr(SuffixTrie, "extend", _resuming_nowhere(SuffixTrie.extend))
    rng = random.Random(SEED + 4)
    proposer, seq = SuffixProposer(depth=6), _growing_sequence(rng.randrange(6) for _ in range(3000))
    local, calls = proposer._local_of(seq), 0
    while not local.caught_up:
        behind = local.behind
        proposer.preview([seq], 4)
        assert behind - local.behind <= max(INDEX_TOKENS, behind // BACKLOG_SHARE)
        seq.token_ids += [rng.randrange(6) for _ in range(3)]  # the step's tokens: indexed with the rest
        calls += 1
    assert calls > 5
    proposer.preview([seq], 4)
    whole = SuffixTrie(6)
    whole.extend(seq.token_ids, {0: seq.token_ids}.get)
    assert (_trie_counts(local.trie) == _trie_counts(whole)) != broken


def test_the_first_step_indexes_what_it_must_and_a_bounded_share_of_long_prompts():
    rng = random.Random(SEED + 5)
    proposer = SuffixProposer()
    long = [_growing_sequence((rng.randrange(1000) for _ in range(n)), slot) for slot, n in enumerate((4000, 2500))]
    short = _growing_sequence((rng.randrange(1000) for _ in range(40)), 2)
    proposer.preview([*long, short], 4)
    locals_ = [proposer._local_of(s) for s in (*long, short)]
    assert not locals_[2].behind  # the fewest behind first
    assert sum(local.indexed for local in locals_) == (4000 + 2500 + 40) // BACKLOG_SHARE
    short.token_ids += [1, 2, 3]
    for _ in range(20):
        proposer.propose([*long, short], [4, 4, 4])
        assert not locals_[2].behind  # indexed whole once: a step's tokens go in at once
    assert not locals_[0].behind and not locals_[1].behind


def test_a_prompt_indexed_in_part_drafts_from_that_part():
    rng = random.Random(SEED + 6)
    early, copied = [rng.randrange(1000) for _ in range(30)], [rng.randrange(1000) for _ in range(12)]
    prompt = early + copied + [rng.randrange(1000) for _ in range(4000)] + early
    proposer, seq = SuffixProposer(), _growing_sequence(prompt)
    (preview,) = proposer.preview([seq], 8)
    assert proposer._local_of(seq).behind  # its end is not indexed yet...
    assert preview.tokens == copied[:8] and preview.match == 23  # ... but what followed its context earlier is


def test_tenant_of_separates_api_keys_and_users():
    from types import SimpleNamespace

    from specdecode.server.handler import tenant_of

    def tenant(key, user):
        request = SimpleNamespace(headers={"authorization": f"Bearer {key}"})
        return tenant_of(SimpleNamespace(user=user), request)

    assert tenant("k1", None) == tenant("k1", None)
    assert len({tenant("k1", None), tenant("k2", None), tenant("k1", "ann"), tenant("k1", "bo")}) == 4
    assert "k1" not in tenant("k1", None)  # the key itself is not kept


# ---- in the engine ----------------------------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43]]


def _outputs(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain_outputs(target):
    return _outputs(LLM(target=target, num_speculative_tokens=0, max_model_len=256))


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_suffix_speculation_matches_plain_decoding(target, plain_outputs, policy, monkeypatch):
    llm = LLM(
        target=target,
        speculative_model="suffix",
        num_speculative_tokens=8,
        max_model_len=256,
        speculation_policy=policy,
    )
    if policy == "adaptive":  # timed beside other tests, its costs may keep it from drafting at all
        priced_without_timing(llm.engine.policy, monkeypatch, len(PROMPTS))
    first = [o for o in llm.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in first] == plain_outputs
    again = llm.generate(PROMPTS, GREEDY)  # now the cache holds the first outputs: long drafts
    assert [o.outputs[0].token_ids for o in again] == plain_outputs
    drafted = sum(o.spec["num_draft_tokens"] for o in again)
    accepted = sum(o.spec["num_accepted_tokens"] for o in again)
    assert accepted > 0.9 * drafted > 0
    assert llm.engine.lookup.cache_bytes > 0


def _cached_outputs(engine):
    engine.lookup.cache.index()
    return [list(tokens) for _, tokens in engine.lookup.cache.texts.values()]


def test_forgetting_cached_prefixes_forgets_earlier_outputs(target):
    """Benchmarks compare configurations on one engine's prompts: none may draft from another's outputs."""
    llm = LLM(target=target, speculative_model="suffix", num_speculative_tokens=4, max_model_len=256)
    llm.generate(PROMPTS[:1], GREEDY)
    assert _cached_outputs(llm.engine)  # the check can fail
    llm.engine.forget_cached_prefixes()
    assert _cached_outputs(llm.engine) == [] and llm.engine.lookup.cache_bytes == 0


def test_an_aborted_output_is_not_kept_and_a_finished_one_is(target):
    engine = LLM(target=target, speculative_model="suffix", num_speculative_tokens=4, max_model_len=256).engine
    aborted = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort(aborted)
    finished = engine.add_request(PROMPTS[1], GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert aborted.output_ids and _cached_outputs(engine) == [finished.output_ids]


def test_a_resumed_sequence_admitted_and_then_turned_back_keeps_nothing_in_the_cache(target, monkeypatch):
    """Its slot taken, the pools found short after all: it waits on with its output so far, which is not one to
    draft from until it finishes."""
    engine = LLM(target=target, speculative_model="suffix", num_speculative_tokens=4, max_model_len=256).engine
    seq = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    engine._preempt(seq)
    monkeypatch.setattr(engine.blocks, "fits", lambda *args, **kwargs: False)
    assert engine._take_slots([seq]) is None and seq.output_ids
    assert _cached_outputs(engine) == []
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
    assert _cached_outputs(engine) == [seq.output_ids]


def test_suffix_beside_a_draft_model_matches_plain_decoding_in_one_batch(
    target, random_draft, plain_outputs, monkeypatch
):
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=4,
        max_model_len=256,
        speculation_policy="adaptive",
        prompt_lookup="suffix",
    )
    priced_without_timing(llm.engine.policy, monkeypatch, len(PROMPTS))
    llm.generate(PROMPTS, GREEDY)
    outputs, step_ks, lookup_drafts = run_as_one_batch(llm.engine, PROMPTS, GREEDY)
    assert outputs == plain_outputs
    assert lookup_drafts > 0 and max(max(ks) for ks in step_ks) > 4  # suffix drafts run past k


def test_accepting_suffix_drafts_unverified_breaks_equality(target, plain_outputs):
    """The checks above can fail: with every draft accepted, the output is the drafts', not the target's."""
    llm = LLM(
        target=target,
        speculative_model="suffix",
        num_speculative_tokens=8,
        max_model_len=256,
        speculation_policy="fixed",
        forced_accept=True,
    )
    llm.generate(PROMPTS, GREEDY)
    assert _outputs(llm) != plain_outputs


@pytest.fixture(scope="module")
def small():
    target = tiny_model(seed=7, vocab=8, hidden=32)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(n=16, temperature=1.0, max_tokens=3, top_k=6, presence_penalty=0.3)
    return target, prompt, params, exact_joint(target, prompt, params)


def test_sampling_with_suffix_drafts_follows_the_target(small):
    """Drafts from the prompt and from the earlier samples' outputs (the cache fills as batches finish)."""
    target, prompt, params, joint = small
    counts, accepted = sampled_joint(target, None, prompt, params, samples=6000, k=3, speculative_model="suffix")
    assert 0.05 < accepted < 0.95
    assert chi2_pvalue(counts, joint) > PASS_P


def test_unverified_suffix_drafts_fail_the_distribution_test(small):
    target, prompt, params, joint = small
    llm = LLM(
        target=target,
        speculative_model="suffix",
        num_speculative_tokens=3,
        max_model_len=64,
        max_num_seqs=128,
        speculation_policy="fixed",
        forced_accept=True,
    )
    counts = {}
    for out in llm.generate([prompt] * (6000 // params.n), params):
        for o in out.outputs:
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert chi2_pvalue(counts, joint) < 1e-6


def test_suffix_proposer_rejects_bad_options():
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixProposer(max_tokens=0)
    with pytest.raises(ValueError, match="scope"):
        SuffixCache(10, "everyone")


def test_through_the_server_each_tenant_drafts_from_its_own_outputs_only(target):
    """Two API keys and two users on one server: each finished output is cached under its tenant, the
    cache's size is in /metrics, and the other tenants' drafts never come from it."""
    import httpx
    import openai
    from conftest import LocalServer

    from specdecode.server.api import build_app
    from specdecode.server.async_engine import AsyncEngine

    llm = LLM(target=target, speculative_model="suffix", num_speculative_tokens=8, max_model_len=256)
    engine = AsyncEngine(llm.engine)
    body = {"ignore_eos": True}
    with LocalServer(build_app(engine, "tiny")) as server:
        outputs = {}
        for key, user in (("k1", "ann"), ("k1", "bo"), ("k2", "ann")):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            r = client.completions.create(
                model="tiny", prompt="hello world", max_tokens=30, temperature=0, user=user, extra_body=body
            )
            outputs[key, user] = r.choices[0].text
        metrics = httpx.get(server.url + "/metrics").text
    cache = llm.engine.lookup.cache
    counted = cache.nbytes
    cache.index()  # the last output waits for a step to index it, which no request here brings
    assert len(cache.tries) == 3 and all(len(cache.tenant_texts(t)) == 1 for t in cache.tries)
    assert len(set(outputs.values())) == 1  # greedy: the same text for everyone, drafted or not
    first, *others = cache.tries
    text = cache.tenant_texts(first)[0]
    assert cache.draft(first, text[:10], 8, 0.1).tokens == text[10:18]
    for other in others:  # the same text, cached apart: drafting from it uses the other tenant's copy
        draft = cache.draft(other, text[:10], 8, 0.1)
        assert cache.texts[draft.source][0] == other
    line = next(x for x in metrics.splitlines() if x.startswith("specdecode_suffix_cache_bytes "))
    assert float(line.split()[1]) == counted > 0
