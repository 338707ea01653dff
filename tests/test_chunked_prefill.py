"""A long prompt that arrives while another sequence decodes is prefilled a chunk a step beside it: the running
stream gets tokens every step meanwhile, and both outputs (and the drafts proposers make) are those of each
request run alone."""

import functools

import pytest
from conftest import ByteTokenizer, lowbit_tiny_model, make_head, tiny_model

from specdecode import LLM, SamplingParams
from specdecode.engine import chunked_prefill
from specdecode.engine import prefill as prefill_module
from specdecode.models.loader import LoadedModel

SHORT = [5, 9, 14, 3, 22, 7, 30, 2]
LONG = [(7 * i) % 60 + 1 for i in range(150)]  # 150 tokens: five chunks of 32
CHUNK = 32
PROPOSERS = ["plain", "draft", "head"]


@functools.cache
def _lowbit_target() -> LoadedModel:
    model = lowbit_tiny_model()
    return LoadedModel("tiny-lowbit", model, ByteTokenizer(model.cfg.vocab_size), model.cfg)


def _llm(kind: str, chunk: int, tmp_path, lowbit: bool = False):
    target = _lowbit_target() if lowbit else tiny_model(seed=0)
    options = dict(num_speculative_tokens=3, speculation_policy="fixed")
    if kind == "plain":
        options = dict(num_speculative_tokens=0)
    elif kind == "draft":
        options["draft"] = tiny_model(seed=0, layers=1)
    else:
        options["speculative_model"] = make_head(target, tmp_path / "head", intermediate=64 if lowbit else 48)
    return LLM(target=target, max_model_len=256, prefill_chunk_tokens=chunk, progress=False, **options)


def _recording_drafts(engine) -> dict[int, list[list[int]]]:
    """Every draft the engine's drafter makes, by the length of the prompt of the sequence it is for."""
    drafts: dict[int, list[list[int]]] = {}
    if engine.proposer is None:
        return drafts
    propose = engine.proposer.propose

    def spy(seqs, ks, feedback):
        out = propose(seqs, ks, feedback)
        for seq, k, tokens in zip(seqs, ks, out.tokens):
            if k:
                drafts.setdefault(len(seq.prompt_ids), []).append(list(tokens))
        return out

    engine.proposer.propose = spy
    return drafts


def _alone(kind, tmp_path, prompt, tokens, lowbit=False):
    engine = _llm(kind, 0, tmp_path, lowbit).engine
    drafts = _recording_drafts(engine)
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return seq, drafts.get(len(prompt))


def _together(kind, tmp_path, lowbit=False):
    """The short request decodes; after two steps the long one arrives. Returns both sequences and, for each
    step until the long one's first token, how many tokens the short one got; the engine counts its target
    calls in those steps (`engine.calls`) and those its timer took as decode forwards (`engine.timed_decode_calls`)."""
    engine = _llm(kind, CHUNK, tmp_path, lowbit).engine
    engine.drafts = _recording_drafts(engine)
    short = engine.add_request(SHORT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(2):
        engine.step()
    long = engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    gains, forward, engine.calls = [], engine.runner.forward, []

    def counted(*args, **kwargs):
        engine.calls.append(len(args[0]))
        return forward(*args, **kwargs)

    engine.runner.forward = counted
    timed = engine.timer.target_calls
    while not long.output_ids:
        before = len(short.output_ids)
        engine.step()
        gains.append(len(short.output_ids) - before)
    engine.runner.forward = forward
    engine.timed_decode_calls = engine.timer.target_calls - timed
    while engine.has_unfinished():
        engine.step()
    return short, long, gains, engine


@pytest.mark.parametrize("kind", PROPOSERS)
def test_a_long_prompt_prefills_in_chunks_beside_a_decoding_stream(kind, tmp_path):
    short, long, gains, engine = _together(kind, tmp_path)
    assert len(gains) == -(-len(LONG) // CHUNK)  # one chunk a step
    assert engine.timed_decode_calls == len(gains)  # the decode forwards timed, the chunks' calls apart
    assert all(g >= 1 for g in gains)  # the running stream never waited
    assert short.output_ids == _alone(kind, tmp_path, SHORT, 60)[0].output_ids
    alone, drafts = _alone(kind, tmp_path, LONG, 12)
    assert long.output_ids == alone.output_ids
    # the same drafts as alone: a head read every prompt row's hidden state, whichever chunk computed it
    assert engine.drafts.get(len(LONG)) == drafts and (kind == "plain" or drafts)
    assert engine.runner.num_free == engine.runner.num_slots and engine.runner.blocks_in_use() == 0


@pytest.mark.parametrize("kind", ["plain", "head"])
def test_a_chunk_rides_in_the_verify_call_where_one_call_packs_both(kind, tmp_path):
    """Where the runner packs any width (the CPU kernels), a step reads the weights once for the stream's verify
    and the prompt's chunk, and every row still computes what it would alone."""
    short, long, gains, engine = _together(kind, tmp_path, lowbit=True)
    assert engine.runner.packs_any_width
    assert engine.calls == [2] * len(gains)  # one target call a step, with both sequences in it
    assert engine.timed_decode_calls == 0  # nor are they timed as decode forwards (the stats' cost ratio c)
    assert all(g >= 1 for g in gains)
    assert short.output_ids == _alone(kind, tmp_path, SHORT, 60, lowbit=True)[0].output_ids
    alone, drafts = _alone(kind, tmp_path, LONG, 12, lowbit=True)
    assert long.output_ids == alone.output_ids
    assert engine.drafts.get(len(LONG)) == drafts
    assert engine.runner.num_free == engine.runner.num_slots and engine.runner.blocks_in_use() == 0


def test_a_chunk_whose_logits_row_is_taken_from_the_verify_rows_samples_another_first_token(tmp_path, monkeypatch):
    """The deliberately broken variant: the chunk's logits row read from the wrong end of the packed call's."""
    verify_forward = chunked_prefill.ChunkedPrefilling._verify_forward

    def misread(self, seqs, inputs, chunk):
        logits, hidden, chunk_out = verify_forward(self, seqs, inputs, chunk)
        return logits, hidden, None if chunk_out is None else (logits[:1], chunk_out[1])

    alone, _ = _alone("plain", tmp_path, LONG, 12, lowbit=True)
    monkeypatch.setattr(chunked_prefill.ChunkedPrefilling, "_verify_forward", misread)
    _, long, _, _ = _together("plain", tmp_path, lowbit=True)
    assert long.output_ids[0] != alone.output_ids[0]


class _NewestFirst(list):
    def append(self, rows):
        self.insert(0, rows)


def test_a_head_given_the_chunks_out_of_order_drafts_otherwise(tmp_path, monkeypatch):
    """The deliberately broken variant: the chunks' hidden states joined newest first."""
    alone, drafts = _alone("head", tmp_path, LONG, 12)
    monkeypatch.setattr(
        prefill_module, "ChunkedPrefill", functools.partial(prefill_module.ChunkedPrefill, hidden=_NewestFirst())
    )
    _, long, _, engine = _together("head", tmp_path)
    assert long.output_ids == alone.output_ids  # still lossless...
    assert engine.drafts[len(LONG)] != drafts  # ...but the head drafted from the wrong context


def test_a_prompt_aborted_while_it_prefills_gives_its_slot_and_blocks_back(tmp_path):
    engine = _llm("plain", CHUNK, tmp_path).engine
    short = engine.add_request(SHORT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    long = engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.num_running == 2 and len(engine.prefilling) == 1
    engine.abort(long)
    assert long.finish_reason == "abort" and not engine.prefilling
    while engine.has_unfinished():
        engine.step()
    assert len(short.output_ids) == 20 and not long.output_ids
    assert engine.runner.num_free == engine.runner.num_slots and engine.runner.blocks_in_use() == 0


def test_without_a_decoding_stream_a_long_prompt_prefills_whole(tmp_path):
    engine = _llm("plain", CHUNK, tmp_path).engine
    long = engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    assert long.output_ids and not engine.prefilling


def test_a_negative_chunk_is_refused():
    with pytest.raises(Exception, match="prefill_chunk_tokens must be >= 0"):
        LLM(target=tiny_model(seed=0), max_model_len=64, prefill_chunk_tokens=-1, progress=False)
