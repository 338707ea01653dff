"""Suffix speculation: the trie counts what a brute-force count says and forgets a text exactly; drafts copy
what followed a match and stop where the counts disagree; the cross-request cache never lets one tenant
draft from another's outputs and stays under its byte cap; in the engine, greedy output equals plain
decoding and sampled outputs follow the target's distribution (and accepting drafts unverified fails
both checks)."""

import random
import tracemalloc

import pytest
from conftest import run_as_one_batch, tiny_model
from stats import PASS_P, SEED, chi2_pvalue, exact_joint, sampled_joint

from specdecode import LLM, SamplingParams
from specdecode.proposers.suffix import SuffixCache, SuffixProposer
from specdecode.proposers.suffix_tree import NODE_BYTES, SuffixTrie

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _substring_counts(texts, depth):
    counts = {}
    for text in texts:
        for i in range(len(text)):
            for j in range(i + 1, min(len(text), i + depth) + 1):
                counts[tuple(text[i:j])] = counts.get(tuple(text[i:j]), 0) + 1
    return counts


def _trie_counts(trie):
    counts, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in (trie.children[node] or {}).items():
            counts[path + (token,)] = trie.counts[child]
            stack.append((child, path + (token,)))
    return counts


# ---- the trie -----------------------------------------------------------------------------------------
def test_trie_counts_every_substring_up_to_its_depth_as_it_grows():
    rng = random.Random(SEED)
    texts = [[rng.randrange(5) for _ in range(rng.randrange(1, 60))] for _ in range(4)]
    trie = SuffixTrie(depth=6)
    for text_id, text in enumerate(texts):
        nodes = None
        for start in range(0, len(text), 7):  # fed in pieces, as a sequence grows
            nodes = trie.extend(text[start : start + 7], text_id, start, nodes)
    assert _trie_counts(trie) == _substring_counts(texts, 6)
    assert trie.num_nodes == len(_substring_counts(texts, 6))


def test_removing_a_text_leaves_what_the_others_alone_would_build():
    rng = random.Random(SEED + 1)
    texts = [[rng.randrange(4) for _ in range(40)] for _ in range(3)]
    trie = SuffixTrie(depth=5)
    for text_id, text in enumerate(texts):
        trie.extend(text, text_id)
    trie.remove(texts[1])
    assert _trie_counts(trie) == _substring_counts([texts[0], texts[2]], 5)
    assert trie.num_nodes == len(_substring_counts([texts[0], texts[2]], 5))
    trie.remove(texts[0])
    trie.remove(texts[2])
    assert trie.num_nodes == 0 and trie.children[0] is None
    trie.extend(texts[1], 7)  # freed nodes are reused
    assert _trie_counts(trie) == _substring_counts([texts[1]], 5)


def test_node_bytes_is_what_a_node_costs():
    rng = random.Random(SEED)
    text = [rng.randrange(150_000) for _ in range(2000)]  # mostly leaves: the costliest case per node
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie = SuffixTrie(depth=16)
    trie.extend(text)
    measured = (tracemalloc.get_traced_memory()[0] - before) / trie.num_nodes
    tracemalloc.stop()
    assert 0.8 * NODE_BYTES < measured < 1.2 * NODE_BYTES


def test_a_draft_copies_what_followed_the_longest_match_beyond_the_trie_depth():
    span = list(range(10, 60))
    text = [1, 2] + span + [3, 4, 5] + span[:6]  # the span is being written again
    trie = SuffixTrie(depth=8)
    open_nodes = trie.extend(text)
    node, match = trie.longest_continued(text)
    assert trie.longest_continued_in(open_nodes) == (node, match)  # the text's own suffix nodes, no walk
    draft = trie.draft_from(node, match, 32, 0.1, lambda _: text)
    assert match == 6 and draft.tokens == span[6:38] and draft.probs == [1.0] * 32


def test_draft_length_follows_how_often_the_continuation_followed():
    """After '0 7 8' came 9 twice and 5 once, so a draft of 9 is right with p = 2/3; '0 7 8 9' was followed
    by 2 both times (p = 1). A draft goes on while the product stays above min_prob."""
    text = [7, 8, 9, 1, 0, 7, 8, 9, 2, 0, 7, 8, 9, 2, 0, 7, 8, 5, 0, 7, 8]
    trie = SuffixTrie(depth=8)
    trie.extend(text)
    node, match = trie.longest_continued(text)
    assert match == 3  # '0 7 8': '5 0 7 8' never occurred before
    assert trie.draft_from(node, match, 10, 0.7, lambda _: text).tokens == []
    loose = trie.draft_from(node, match, 10, 0.5, lambda _: text)
    assert loose.tokens[:2] == [9, 2] and loose.probs[:2] == pytest.approx([2 / 3, 1.0])


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
    for output in secrets["alice"]:
        context = output[:20]
        assert cache.draft("alice", context, 32, 0.1).tokens == output[20:50][:30]
        assert cache.draft("bob", context, 32, 0.1).tokens == []  # bob never sees alice's text
        assert cache.draft("mallory", context, 32, 0.1).tokens == []
    assert cache.tenant_texts("bob") == secrets["bob"]
    shared = SuffixCache(1 << 30, "global")  # the check above can fail: a shared cache leaks
    shared.add("alice", secrets["alice"][0])
    assert shared.draft("bob", secrets["alice"][0][:20], 32, 0.1).tokens


def test_the_cache_stays_under_its_byte_cap_and_evicts_the_least_recently_used():
    rng = random.Random(SEED)
    outputs = [[rng.randrange(1000) for _ in range(100)] for _ in range(20)]
    one = SuffixCache(1 << 30)
    one.add("t", outputs[0])
    cap = int(one.nbytes * 5.5)  # room for five outputs
    cache = SuffixCache(cap)
    for i, output in enumerate(outputs):
        cache.add("t", output)
        assert cache.nbytes <= cap
        if i == 2:
            assert cache.draft("t", outputs[0][:30], 32, 0.1).tokens  # the oldest, used: kept
    kept = cache.tenant_texts("t")
    assert len(kept) == 5 and outputs[0] not in kept and kept == outputs[-5:]  # FIFO until used again...
    lru = SuffixCache(cap)
    for output in outputs[:8]:
        lru.add("t", output)
        assert lru.draft("t", outputs[0][:30], 32, 0.1).tokens  # ... and kept while drafted from
    assert outputs[0] in lru.tenant_texts("t") and outputs[1] not in lru.tenant_texts("t")
    for _ in lru.tenant_texts("t"):
        lru._evict(next(iter(lru.texts)))
    assert lru.nbytes == 0 and not lru.tries


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
def test_suffix_speculation_matches_plain_decoding(target, plain_outputs, policy):
    llm = LLM(
        target=target,
        speculative_model="suffix",
        num_speculative_tokens=8,
        max_model_len=256,
        speculation_policy=policy,
    )
    first = [o for o in llm.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in first] == plain_outputs
    again = llm.generate(PROMPTS, GREEDY)  # now the cache holds the first outputs: long drafts
    assert [o.outputs[0].token_ids for o in again] == plain_outputs
    drafted = sum(o.spec["num_draft_tokens"] for o in again)
    accepted = sum(o.spec["num_accepted_tokens"] for o in again)
    assert accepted > 0.9 * drafted > 0
    assert llm.engine.lookup.cache_bytes > 0


def test_suffix_beside_a_draft_model_matches_plain_decoding_in_one_batch(target, random_draft, plain_outputs):
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=4,
        max_model_len=256,
        speculation_policy="adaptive",
        prompt_lookup="suffix",
    )
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
    assert len(cache.tries) == 3 and all(len(cache.tenant_texts(t)) == 1 for t in cache.tries)
    assert len(set(outputs.values())) == 1  # greedy: the same text for everyone, drafted or not
    first, *others = cache.tries
    text = cache.tenant_texts(first)[0]
    assert cache.draft(first, text[:10], 8, 0.1).tokens == text[10:18]
    for other in others:  # the same text, cached apart: drafting from it uses the other tenant's copy
        draft = cache.draft(other, text[:10], 8, 0.1)
        assert cache.texts[draft.source][0] == other
    line = next(x for x in metrics.splitlines() if x.startswith("specdecode_suffix_cache_bytes "))
    assert float(line.split()[1]) == cache.nbytes > 0
