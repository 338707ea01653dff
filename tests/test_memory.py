"""The memory plan: weights and both KV caches placed in a byte budget, slots sized to what fits,
requests beyond the slots wait in the queue, a budget that can never hold a sequence is refused, and a
draft head's unread features are counted per token."""

import pytest
import torch
from conftest import make_head, tiny_model

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.engine.memory import kv_bytes_per_token, parse_bytes, plan_memory

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_parse_bytes():
    assert parse_bytes("6GiB") == 6 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("2.5g") == 2_500_000_000
    assert parse_bytes(1234) == 1234
    with pytest.raises(SpecDecodeError, match="write it like 6GiB"):
        parse_bytes("lots")


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer(target):
    cfg = target.config
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_per_head * 4
    # the engine's cache takes exactly that per token its blocks hold: without a budget, every slot's full length
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=100, max_num_seqs=3)
    cache = llm.engine.runner._cache
    assert cache.num_blocks == 3 * -(-100 // cache.block_size)
    assert sum(
        t.numel() * t.element_size() for t in cache.k + cache.v
    ) == cache.num_blocks * cache.block_size * kv_bytes_per_token(cfg, torch.float32)


def test_a_float16_cache_takes_half_the_bytes_and_the_plan_counts_them(target):
    cfg, model = target.config, target.model
    model.kv_cache_dtype = torch.float16
    try:
        llm = LLM(target=target, num_speculative_tokens=0, max_model_len=100, max_num_seqs=3)
        cache = llm.engine.runner._cache
        assert cache.k[0].dtype == torch.float16
        assert sum(
            t.numel() * t.element_size() for t in cache.k + cache.v
        ) == cache.num_blocks * cache.block_size * kv_bytes_per_token(cfg, torch.float16)
        assert llm.memory_plan.kv_bytes_per_token == kv_bytes_per_token(cfg, torch.float32) // 2
    finally:
        model.kv_cache_dtype = None


def test_an_unknown_cache_dtype_is_refused_with_the_choices(target):
    with pytest.raises(SpecDecodeError, match="unknown kv_cache_dtype 'int4'; use one of auto, float16, float32"):
        LLM(target=target, kv_cache_dtype="int4")


def test_the_budget_decides_the_number_of_kv_blocks(target, random_draft):
    fixed = plan_memory(target.model, random_draft.model, 128, 64, 4, None)
    per_block = fixed.block_size * fixed.kv_bytes_per_token
    assert fixed.num_slots == 64 and fixed.num_blocks == 64 * 128 // fixed.block_size  # no budget: what was asked
    weights = target.model.weight_bytes() + random_draft.model.weight_bytes() + fixed.reserve_bytes
    plan = plan_memory(target.model, random_draft.model, 128, 64, 4, weights + 7 * per_block + per_block // 2)
    assert plan.num_blocks == 7 and plan.num_slots == 64
    assert plan.kv_cache_bytes == 7 * per_block
    assert f"{7 * fixed.block_size} tokens in blocks of {fixed.block_size}" in plan.summary()
    assert plan_memory(target.model, random_draft.model, 128, 2, 4, weights + 10 * per_block).num_blocks == 4


def test_a_budget_that_never_fits_a_sequence_is_refused(target, random_draft):
    plan = plan_memory(target.model, random_draft.model, 256, 8, 4, None)
    fixed = plan.target_weight_bytes + plan.draft_weight_bytes + plan.reserve_bytes
    with pytest.raises(SpecDecodeError, match="raise the memory budget or lower max_model_len to at most 64$"):
        LLM(
            target=target,
            draft=random_draft,
            max_model_len=256,
            draft_quantization="none",
            memory_budget=fixed + 100 * plan.kv_bytes_per_token,
        )
    with pytest.raises(SpecDecodeError, match="smaller than the weights and activations"):
        LLM(target=target, draft=random_draft, max_model_len=256, memory_budget=1000)


def test_a_context_whose_cache_would_not_fit_is_served_as_far_as_it_fits(target, monkeypatch):
    """Without max_model_len, a model whose one sequence at its full context would not fit the memory (DeepSeek's
    expanded cache: 54 GiB at V2-Lite's 163,840 tokens) is served up to what does, in whole blocks, with a warning
    that says so, the sequence then fitting; with max_model_len given, it is what is served, as it was."""
    from specdecode.engine import memory
    from specdecode.kv_cache import BLOCK_TOKENS

    per_token = kv_bytes_per_token(target.config, target.model.kv_dtype)
    reserve = memory.activation_reserve(target.config, target.model.dtype, target.config.max_position, 1, 0)
    options = dict(num_speculative_tokens=0, max_num_seqs=1)
    room = (2 * BLOCK_TOKENS + BLOCK_TOKENS // 2) * per_token  # two blocks and a half, AVAILABLE_SHARE of it available
    monkeypatch.setattr(memory, "available_memory", lambda device: int(room / memory.AVAILABLE_SHARE) + reserve + 1)
    served = 2 * BLOCK_TOKENS
    assert served < target.config.max_position
    with pytest.warns(UserWarning, match=rf"sequences are served up to {served} tokens; set max_model_len to choose"):
        llm = LLM(target=target, **options)
    assert llm.max_model_len == served
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=served, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == served - 3  # the prompt and its output within what is served
    budget = target.model.weight_bytes() + reserve + (BLOCK_TOKENS + 1) * per_token
    with pytest.warns(UserWarning, match=rf"served up to {BLOCK_TOKENS} tokens"):
        assert LLM(target=target, memory_budget=budget, **options).max_model_len == BLOCK_TOKENS
    assert LLM(target=target, max_model_len=100, **options).max_model_len == 100


def test_requests_beyond_the_kv_blocks_wait_and_all_complete(target, random_draft):
    """Two blocks of KV cache for sequences of up to 64 tokens (one block each): eight slots, two running at a
    time; a request that could never fit is refused with what to change."""
    plan = plan_memory(target.model, random_draft.model, 64, 8, 3, None)
    budget = plan.budget_holding(2)
    llm = LLM(
        target=target,
        draft=random_draft,
        num_speculative_tokens=3,
        max_model_len=64,
        max_num_seqs=8,
        draft_quantization="none",
        memory_budget=budget,
    )
    assert llm.memory_plan.num_blocks == llm.engine.runner.num_blocks == 2 and llm.engine.runner.num_slots == 8
    prompts = [f"request {i}" for i in range(5)]
    alone = [LLM(target=target, num_speculative_tokens=0, max_model_len=64).generate(p, PARAMS)[0] for p in prompts]
    seqs = [llm.engine.add_request(target.tokenizer.encode(p), PARAMS) for p in prompts]
    most_running = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        most_running = max(most_running, len(llm.engine.running))
        assert llm.engine.runner.blocks_in_use() <= 2
    assert most_running == 2
    assert [s.output_ids for s in seqs] == [a.outputs[0].token_ids for a in alone]
    with pytest.raises(SpecDecodeError, match="lower max_tokens or n, or raise the memory budget"):
        llm.generate(["x"], SamplingParams(n=3, max_tokens=8))


def test_the_plan_counts_a_draft_heads_unread_features_per_token(target, tmp_path):
    row = target.config.hidden_size * torch.empty((), dtype=target.model.dtype).element_size()
    plain = plan_memory(target.model, None, 128, 4, 3, None)
    assert plan_memory(target.model, None, 128, 4, 3, None, features=True).kv_bytes_per_token == (
        plain.kv_bytes_per_token + row
    )
    llm = LLM(
        target=target,
        speculative_model=make_head(target, tmp_path / "head"),
        num_speculative_tokens=2,
        max_model_len=128,
        max_num_seqs=4,
    )
    head = llm.engine.proposer.model
    assert llm.memory_plan.kv_bytes_per_token == plain.kv_bytes_per_token + row + kv_bytes_per_token(
        head.cfg, head.kv_dtype
    )


def _into_one_arena(model) -> None:
    """Every weight a view into one buffer, as move_to_huge_pages leaves them (tied weights still tied)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    arena = torch.empty(sum(t.numel() * t.element_size() for t in tensors.values()), dtype=torch.uint8)
    places, at = {}, 0
    for ptr, t in tensors.items():
        size = t.numel() * t.element_size()
        places[ptr] = arena[at : at + size].view(t.dtype).view(t.shape).copy_(t)
        at += size
    with torch.no_grad():
        model._apply(lambda t: places.get(t.data_ptr(), t))


def test_weights_in_one_arena_count_their_own_bytes_and_a_head_what_it_adds(tmp_path):
    """On huge pages every weight is a view into one arena: counted by its storage, each weight counted the
    whole arena (a 1.1 GB target planned as 2.2 GB, its 39 MB head as 22 GB)."""
    from specdecode.models.draft_head import HeadSpec, build_head, target_fingerprint

    target = tiny_model(seed=0).model
    weights = {t.data_ptr(): t for t in [*target.parameters(), *target.buffers()]}  # the tied embedding once
    expected = sum(t.numel() * t.element_size() for t in weights.values())
    _into_one_arena(target)
    assert target.weight_bytes() == expected
    spec = HeadSpec("tiny", target_fingerprint(target), 48, 32)
    head = build_head(spec, None, target, torch.arange(32))
    _into_one_arena(head)
    owned = sum(p.numel() * p.element_size() for name in head.OWNED for p in head.get_submodule(name).parameters())
    assert head.weight_bytes() == owned + 32 * target.cfg.hidden_size * 4  # and its LM head's 32 rows
    assert target.weight_bytes() == expected


def test_a_gpu_plan_reserves_what_chained_rounds_hold(target, random_draft, monkeypatch):
    """On a GPU a drafter's chained rounds keep the first round's logits per bucket, and sampled ones q per bucket and
    number of rounds (executor/draft_chain.py): the plan reserves their most beside the activations, so the KV pools
    leave room for them; a CPU (no chains there) and a target without a drafter reserve nothing for them. The paged
    attention kernels' partial sums are reserved on a GPU, the larger model's."""
    from specdecode.engine.memory import captured_outputs_reserve, chained_rounds_reserve, split_sums_reserve

    on_cpu = plan_memory(target.model, random_draft.model, 128, 48, 4, None)
    monkeypatch.setattr(type(target.model), "device", property(lambda self: torch.device("cuda")))
    on_gpu = plan_memory(target.model, random_draft.model, 128, 48, 4, None)
    alone = plan_memory(target.model, None, 128, 48, 4, None)
    vocab = target.config.vocab_size
    graphs = captured_outputs_reserve([target.model, random_draft.model], 128, 48)  # what captured graphs keep
    assert graphs > 0 and captured_outputs_reserve([target.model], 128, 48) < graphs
    sums = split_sums_reserve([target.model, random_draft.model])
    cfg = target.config
    assert sums == max(split_sums_reserve([target.model]), split_sums_reserve([random_draft.model]))
    assert split_sums_reserve([target.model]) == 64 * 64 * 4096 // 512 * cfg.num_heads * (cfg.dim_per_head + 2) * 4
    assert on_gpu.reserve_bytes - on_cpu.reserve_bytes == chained_rounds_reserve(cfg, 48, 4) + graphs + sums
    assert chained_rounds_reserve(cfg, 48, 4) == 2 * 64 * (1 + 2 + 3 + 4) * vocab * 4
    alone_sums = split_sums_reserve([target.model])
    assert alone.reserve_bytes == on_cpu.reserve_bytes + captured_outputs_reserve([target.model], 128, 48) + alone_sums


def test_a_gpu_plan_without_a_budget_holds_what_the_device_has_free(target, random_draft, monkeypatch):
    """gpu_memory_utilization=None on a GPU: the pools hold max_num_seqs sequences as far as the device's free memory
    goes (its share beside the activations' reserve), since a GPU's pools are taken whole at start-up; where not one
    sequence fits, the error says what to lower."""
    from specdecode.engine import memory

    monkeypatch.setattr(type(target.model), "device", property(lambda self: torch.device("cuda")))
    full = plan_memory(target.model, random_draft.model, 128, 48, 4, None, features=True)  # no CUDA: nothing free said
    assert full.num_blocks == 48 * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    per_block = full.block_size * full.kv_bytes_per_token
    for blocks in (5, 40, 1000):
        free = full.reserve_bytes + int(blocks * per_block / memory.AVAILABLE_SHARE) + 1
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 10 * free))
        plan = plan_memory(target.model, random_draft.model, 128, 48, 4, None, features=True)
        assert plan.num_blocks == min(blocks, 48 * 2), blocks  # 128 tokens: two blocks a sequence
        assert f"80% of the {memory.format_bytes(free)} available" in plan.summary()  # start-up says why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (full.reserve_bytes + per_block, 10**12))
    with pytest.raises(SpecDecodeError, match="lower max_model_len or max_num_seqs, or set gpu_memory_utilization"):
        plan_memory(target.model, random_draft.model, 128, 48, 4, None, features=True)


def test_a_self_draft_shares_the_targets_weights_but_not_its_kv_cache(target):
    """A draft that is the target model itself drafts from a KV pool of its own (the proposer's runner), as large as
    the target's: the plan counts its entries, not its weights again."""
    alone = plan_memory(target.model, None, 128, 4, 3, None)
    selfdraft = plan_memory(target.model, target.model, 128, 4, 3, None)
    assert selfdraft.draft_weight_bytes == 0
    assert selfdraft.kv_bytes_per_token == 2 * alone.kv_bytes_per_token


def test_a_cpu_plan_counts_what_lookup_proposers_index_per_token(target, monkeypatch):
    """Prompt lookup and suffix speculation index each running sequence's text in host memory, a few hundred bytes
    to a few kilobytes a token: a CPU's plan counts it beside the KV cache (the host's memory is its budget); a GPU's
    does not (its budget is the device's)."""
    from specdecode.proposers import NgramProposer
    from specdecode.proposers.suffix import SuffixProposer

    indexes = NgramProposer().host_bytes_per_token + SuffixProposer().host_bytes_per_token
    assert NgramProposer().host_bytes_per_token > 0 and SuffixProposer().host_bytes_per_token > 1000
    plain = plan_memory(target.model, None, 128, 4, 3, None)
    assert plan_memory(target.model, None, 128, 4, 3, None, False, indexes).kv_bytes_per_token == (
        plain.kv_bytes_per_token + indexes
    )
    llm = LLM(target=target, speculative_model="suffix", num_speculative_tokens=2, max_model_len=128, max_num_seqs=4)
    assert llm.memory_plan.kv_bytes_per_token > plain.kv_bytes_per_token  # the engine passes its proposers' indexes
    monkeypatch.setattr(type(target.model), "device", property(lambda self: torch.device("cuda")))
    on_gpu = plan_memory(target.model, None, 128, 4, 3, None, False, indexes)
    assert on_gpu.kv_bytes_per_token == plain.kv_bytes_per_token
