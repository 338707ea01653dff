"""Prompts admitted in one step prefill together, in as few forwards as the runner packs them
(`runner.forward_calls`): each prompt gets the first token, the hidden states and so the drafts it gets alone. A
padded call of prompts of several lengths (a GPU's way) writes its real rows alone and returns their hidden states
alone."""

import functools

import pytest
import torch
from conftest import DEVICE, ByteTokenizer, lowbit_tiny_model, make_head, tiny_model

from specdecode import LLM, SamplingParams
from specdecode.executor import runner as runner_module
from specdecode.executor.runner import ModelRunner, forward_calls
from specdecode.models.loader import LoadedModel
from specdecode.models.runtime import ForwardBatch

PROMPTS = [[(5 * i + 3 * j) % 60 + 1 for i in range(n)] for j, n in enumerate((9, 40, 23, 70))]
PROPOSERS = ["plain", "draft", "head"]


@functools.cache
def _lowbit_target() -> LoadedModel:
    """Rows of any lengths side by side in one call, each computed as alone (low-bit layers, attention kernel)."""
    model = lowbit_tiny_model()
    return LoadedModel("tiny-lowbit", model, ByteTokenizer(model.cfg.vocab_size), model.cfg)


def _engine(kind: str, tmp_path):
    target, options = _lowbit_target(), dict(num_speculative_tokens=3, speculation_policy="fixed")
    if kind == "plain":
        options = dict(num_speculative_tokens=0)
    elif kind == "draft":
        options["draft"] = tiny_model(seed=0, layers=1)
    else:
        options["speculative_model"] = make_head(target, tmp_path / "head", intermediate=64)
    # every prompt at once: a long one is not left to chunks beside the others
    options.update(max_model_len=256, max_num_seqs=8, prefix_caching=False, prefill_chunk_tokens=0, progress=False)
    return LLM(target=target, **options).engine


def _run(engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[list[int]]], list[int]]:
    """Every prompt queued before the first step: (outputs, each sequence's drafts, the target's forward calls in the
    step that admitted them)."""
    drafts: list[list[list[int]]] = [[] for _ in prompts]
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)) for p in prompts]
    if engine.proposer is not None:
        propose = engine.proposer.propose

        def spy(batch, ks, feedback):
            out = propose(batch, ks, feedback)
            for seq, k, tokens in zip(batch, ks, out.tokens):
                if k:
                    drafts[seqs.index(seq)].append(list(tokens))
            return out

        engine.proposer.propose = spy
    calls, call = [], engine.runner._forward_call
    engine.runner._forward_call = lambda slots, *a, **k: calls.append(len(slots)) or call(slots, *a, **k)
    engine.step()
    engine.runner._forward_call = call
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs], drafts, calls


# the engine on the CPU's low-bit kernels, whose rows are computed as alone (the padded test below runs on CUDA too)
on_the_cpu = pytest.mark.skipif(DEVICE != "cpu", reason="the low-bit kernels run on a CPU")


@on_the_cpu
@pytest.mark.parametrize("kind", PROPOSERS)
def test_prompts_admitted_together_prefill_in_one_forward_as_each_alone(kind, tmp_path):
    outputs, drafts, calls = _run(_engine(kind, tmp_path), PROMPTS)
    assert calls == [len(PROMPTS)]  # one forward of the target for all four prompts
    for prompt, output, drafted in zip(PROMPTS, outputs, drafts):
        alone_output, alone_drafts, _ = _run(_engine(kind, tmp_path), [prompt])
        assert output == alone_output[0]
        assert drafted == alone_drafts[0] and (kind == "plain" or drafted)  # drafted from the same context


@on_the_cpu
@pytest.mark.parametrize("mistake", ["logits", "hidden"])
def test_prompts_given_each_others_rows_answer_or_draft_otherwise(mistake, tmp_path):
    """The deliberately broken variants: the prompts' forward hands each prompt another's last logits row, or
    the head another's hidden states."""
    engine = _engine("head", tmp_path)
    forward = engine.runner.forward

    def mixed_up(slots, inputs, logits="last", hidden=False, features=None):
        out, hidden_rows = forward(slots, inputs, logits, hidden, features)  # the head reads every call's
        if len(inputs) > 1 and hidden == "all":
            if mistake == "logits":
                out = out.roll(1, 0)
            else:
                hidden_rows = hidden_rows.roll(len(inputs[0]), 0)
        return out, hidden_rows

    engine.runner.forward = mixed_up
    outputs, drafts, _ = _run(engine, PROMPTS)
    alone = [_run(_engine("head", tmp_path), [prompt]) for prompt in PROMPTS]
    if mistake == "logits":
        assert outputs != [output[0] for output, _, _ in alone]
    else:
        assert outputs == [output[0] for output, _, _ in alone]  # still lossless...
        assert drafts != [drafted[0] for _, drafted, _ in alone]  # ...but drafted from another prompt's context


def test_forward_calls_pack_in_order_and_pad_by_length_within_the_row_bound():
    lengths = [30, 900, 50, 1500, 3000, 1200]
    # packed (any width): side by side in order, at most 2,048 rows a call; a longer input alone
    assert forward_calls(lengths, float("inf"), 2048, pads=False) == [[0, 1, 2], [3], [4], [5]]
    # rows attended one by one up to 64: the short ones packed, the longer ones padded by length (rows counted
    # padded: 2 x 1,200 > 2,048), in several lengths only where the device pads
    assert forward_calls(lengths, 64, 2048, pads=True) == [[1], [5], [3], [4], [0, 2]]
    assert forward_calls([100, 120, 130, 70], 64, 2048, pads=True) == [[3, 0, 1, 2]]
    assert forward_calls([100, 120, 100, 70], 64, 2048, pads=False) == [[3], [0, 2], [1]]
    assert forward_calls([3, 1, 5], 64, 2048, pads=True) == [[0, 1, 2]]  # a verify step: one call as it is
    # where fixed shapes serve calls (at most 64 rows in all, here), short inputs are packed as far as one serves them
    assert forward_calls([40, 20, 10, 30], 64, 2048, pads=True, serves=lambda n, end: sum(n) <= 64) == [[0, 1], [2, 3]]
    assert forward_calls([1] * 5, 64, 2048, pads=True, serves=lambda n, end: len(n) <= 4) == [[0, 1, 2, 3], [4]]
    # and those none serves share an eager call
    assert forward_calls([40, 20, 10], 64, 2048, pads=True, serves=lambda n, end: False) == [[0, 1, 2]]
    # a prompt after 30,000 cached tokens: padded beside it, another would gather as many keys
    assert forward_calls([100, 120], 64, 2048, pads=True, ends=[30_100, 120]) == [[0], [1]]
    assert forward_calls([100, 120], 64, 2048, pads=True, ends=[900, 120]) == [[0, 1]]


@pytest.mark.parametrize("padding_written", [False, True])
def test_a_padded_call_of_several_lengths_leaves_other_slots_entries_as_they_were(padding_written, monkeypatch):
    """Two prompts of 70 and 140 tokens in one padded call (attention by PyTorch, as on a GPU): each one's logits
    and hidden states are those it gets alone, and a sequence computed before keeps its keys. Writing the
    padding rows too (the deliberately broken variant) writes the shorter prompt's padding at positions past its
    reserved blocks, into the first sequence's block."""
    monkeypatch.setattr(runner_module, "PADS_PROMPTS_TOGETHER", {"cpu", "cuda"})
    if padding_written:
        build = ForwardBatch.build.__func__
        monkeypatch.setattr(ForwardBatch, "build", classmethod(lambda cls, *a, **k: _without_real(build(cls, *a, **k))))
    model = tiny_model(seed=0).model
    assert model.layers[0].self_attn.rowwise_kernel is None  # prompts past 64 tokens take the padded path
    prompts = [[(3 * i + 1) % 60 + 1 for i in range(n)] for n in (70, 140)]
    runner = ModelRunner(model, 3, 256)
    first = runner.allocate()
    runner.forward([first], [list(range(2, 42))])
    runner.commit(first, 40)
    keys = runner._cache.keys(0, first, 40).clone()
    calls, call = [], runner._forward_call
    runner._forward_call = lambda slots, *a, **k: calls.append(len(slots)) or call(slots, *a, **k)
    slots = [runner.allocate(), runner.allocate()]
    logits, hidden = runner.forward(slots, prompts, "last", hidden="all")
    assert calls == [2]
    assert torch.equal(runner._cache.keys(0, first, 40), keys) != padding_written
    if padding_written:
        return
    assert hidden.shape[0] == 70 + 140
    for i, prompt in enumerate(prompts):
        alone = ModelRunner(model, 1, 256)
        alone_logits, alone_hidden = alone.forward([alone.allocate()], [prompt], "last", hidden="all")
        torch.testing.assert_close(logits[i : i + 1], alone_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[70 * i : 70 * i + len(prompt)], alone_hidden, atol=1e-4, rtol=1e-4)


def _without_real(batch: ForwardBatch) -> ForwardBatch:
    batch.real = None
    return batch


@pytest.mark.parametrize("bucketed", [True, False])
def test_short_prompts_together_run_at_bucket_shapes_rather_than_eagerly(bucketed, monkeypatch):
    """Twenty prompts of 40 tokens where forwards run at fixed shapes (CUDA graphs' buckets, at most 1,024 rows, their
    outputs kept within the plan's bound): in two bucket forwards (16 and 4 prompts), none eager, each prompt's
    logits those it gets alone. Packed as if no bucket bounded them (the deliberately broken variant), they run in
    one eager call, which on a GPU attends its 800 rows a token at a time."""
    monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: True)
    if not bucketed:
        calls = runner_module.forward_calls
        monkeypatch.setattr(runner_module, "forward_calls", lambda *args: calls(*args[:5]))
    eager, build = [], ForwardBatch.build.__func__
    monkeypatch.setattr(ForwardBatch, "build", classmethod(lambda cls, *a, **k: eager.append(1) or build(cls, *a, **k)))
    model = tiny_model(seed=0).model
    prompts = [[(7 * i + j) % 60 + 1 for i in range(40)] for j in range(20)]
    runner = ModelRunner(model, len(prompts), 256)
    logits = runner.forward([runner.allocate() for _ in prompts], prompts)
    assert (eager, len(runner._fixed.buckets)) == (([], 2) if bucketed else ([1], 0))
    for i in (0, 19):
        alone = ModelRunner(model, 1, 256)
        torch.testing.assert_close(
            logits[i : i + 1], alone.forward([alone.allocate()], [prompts[i]]), atol=1e-4, rtol=1e-4
        )
