"""The executor seam: a slot's KV entries become context only when committed, never past what a forward
wrote; rollback moves the pointer back; hidden states come with the logits of the same rows."""

import pytest
import torch

from specdecode.executor import runner as runner_module
from specdecode.executor.runner import ModelRunner
from specdecode.models import runtime


def test_commit_cannot_pass_what_the_forwards_wrote(target):
    runner = ModelRunner(target.model, 2, 32)
    slot = runner.allocate()
    runner.forward([slot], [[1, 2, 3]], "last")
    assert runner.length(slot) == 0  # written, not yet context
    runner.commit(slot, 2)  # accept a prefix; the third entry is dropped
    with pytest.raises(ValueError, match="cannot commit 3 tokens"):
        runner.commit(slot, 3)
    runner.forward([slot], [[4, 5]], "all")
    runner.commit(slot, 4)
    runner.rollback(slot, 1)
    assert runner.length(slot) == 1
    with pytest.raises(ValueError):
        runner.commit(slot, 2)  # rolled-back entries are stale
    runner.free(slot)
    assert runner.num_free == 2


def test_a_forward_past_the_context_is_refused(target):
    runner = ModelRunner(target.model, 1, 8)
    slot = runner.allocate()
    with pytest.raises(ValueError, match="context of 8 tokens"):
        runner.forward([slot], [list(range(9))], "last")


def test_an_eager_forward_copies_its_sequences_tokens_to_the_device_at_once(target, monkeypatch):
    """On a GPU a copy of host values waits for the device's queued work (transfers.py): an eager forward of several
    sequences sends their new tokens in one copy queued behind that work, not a waiting copy each, and each
    sequence's logits are those it gets alone."""
    inputs, copied = [[1, 2, 3], [4], [5, 6]], []
    to_device = runner_module.to_device

    def counted(values, device, *args):
        copied.append(list(values))
        return to_device(values, device, *args)

    runner = ModelRunner(target.model, 3, 32, fixed_shapes=False)
    monkeypatch.setattr(runner_module, "to_device", counted)
    together = runner.forward([runner.allocate() for _ in inputs], inputs, "all")
    assert copied == [[1, 2, 3, 4, 5, 6]]
    monkeypatch.undo()
    alone = []
    for tokens in inputs:
        runner = ModelRunner(target.model, 1, 32, fixed_shapes=False)
        alone.append(runner.forward([runner.allocate()], [tokens], "all"))
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=0)


def test_hidden_states_are_the_rows_the_logits_come_from(target):
    model = target.model
    runner = ModelRunner(model, 2, 32)
    slots = [runner.allocate(), runner.allocate()]
    logits, hidden = runner.forward(slots, [[1, 2, 3], [4, 5]], "all", hidden=True)
    assert hidden.shape == (5, model.cfg.hidden_size)
    torch.testing.assert_close(logits, model.lm_head(model.norm(hidden)).float())


def _alone_and_together(model, inputs, logits, hidden):
    """Each input's outputs run alone, all inputs' outputs from one runner.forward, and the token shapes
    of the model calls that forward made."""
    alone = []
    for tokens in inputs:
        runner = ModelRunner(model, 1, 128, fixed_shapes=False)  # the eager layout's calls
        out = runner.forward([runner.allocate()], [tokens], logits, hidden=hidden)
        alone.append(out if isinstance(out, tuple) else (out,))
    runner = ModelRunner(model, len(inputs), 128, fixed_shapes=False)
    slots = [runner.allocate() for _ in inputs]
    shapes = []
    forward = model.forward

    def spy(tokens, batch, cache, **kwargs):
        shapes.append(tuple(tokens.shape))
        return forward(tokens, batch, cache, **kwargs)

    model.forward = spy
    try:
        together = runner.forward(slots, inputs, logits, hidden=hidden)
    finally:
        del model.forward
    return alone, together if isinstance(together, tuple) else (together,), shapes


def _assert_same_rows(alone, together):
    for k, part in enumerate(together):
        torch.testing.assert_close(part, torch.cat([out[k] for out in alone]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("logits, hidden", [("last", False), ("all", True), ("last", "all")])
def test_a_long_input_runs_apart_and_its_outputs_come_back_in_order(target, logits, hidden):
    """A prompt-long input beside short ones (a draft catching up on a prompt while others draft): one
    padded call would compute every sequence to the longest length, so each long input runs in a call of
    its own; the outputs are those of each sequence run alone, in sequence order."""
    inputs = [[3, 4], [(7 * i) % 60 + 1 for i in range(100)], [5], [(3 * i) % 50 + 2 for i in range(70)]]
    alone, together, shapes = _alone_and_together(target.model, inputs, logits, hidden)
    assert sorted(shapes) == [(1, 3), (1, 70), (1, 100)]  # the long ones alone, the short ones packed
    _assert_same_rows(alone, together)


def test_long_inputs_of_one_length_share_a_call(target):
    """Chunks of one length (a distill recording's) pad nothing, so they run in one call, with each
    sequence's outputs as when run alone."""
    inputs = [[(k * i) % 60 + 1 for i in range(90)] for k in (3, 5, 7)]
    alone, together, shapes = _alone_and_together(target.model, inputs, "all", True)
    assert len(shapes) == 1
    _assert_same_rows(alone, together)


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "bucket shapes"])
def test_tokens_picked_on_the_device_after_a_first_from_the_host_are_read_in_place(target, fixed):
    """A verify reading drafts where a drafter left them (forward_picked with each sequence's last token from the
    host): the logits a forward of the same tokens from the host gives, every row, whatever its width; the written
    rows settle to those ids."""
    prompts, drafts = [[5, 6, 7], [8, 9]], [[11, 12, 13], [14, 0, 0]]  # the second sequence drafted one
    widths = [4, 2]
    outs = []
    for picked in (False, True):
        runner = ModelRunner(target.model, 2, 64, fixed_shapes=fixed)
        slots = [runner.allocate(), runner.allocate()]
        runner.forward(slots, [p[:-1] for p in prompts], "last")
        for slot, prompt in zip(slots, prompts):
            runner.commit(slot, len(prompt) - 1)
        if picked:
            on_device = torch.tensor(drafts, device=target.model.device)
            last = [p[-1] for p in prompts]
            outs.append(runner.forward_picked(slots, on_device, widths, first=last, logits="all"))
            for slot, prompt, mine, width in zip(slots, prompts, drafts, widths):
                runner.settle(slot, len(prompt), mine[: width - 1])
        else:
            inputs = [[p[-1], *d[: w - 1]] for p, d, w in zip(prompts, drafts, widths)]
            outs.append(runner.forward(slots, inputs, "all"))
        for slot, prompt, width in zip(slots, prompts, widths):
            runner.commit(slot, len(prompt) - 1 + width)  # settled ids: committed as a step would
    torch.testing.assert_close(outs[1], outs[0])


@pytest.mark.parametrize("broken", [False, True])
def test_masked_attention_with_the_kv_heads_repeated_computes_grouped_query_attention(target, monkeypatch, broken):
    """A GPU's masked attention (prompts, eager forwards) repeats each KV head for its query heads, so that PyTorch
    keeps a fused kernel: the outputs are those of grouped-query attention. Broken: the heads tiled (0, 1, 0, 1)
    rather than each repeated (0, 0, 1, 1), pairing query heads with another group's keys."""
    prompt = [(7 * i + 3) % 60 + 1 for i in range(100)]  # wider than calls attended row by row: one masked call

    def prefill():
        runner = ModelRunner(target.model, 1, 128, fixed_shapes=False)
        return runner.forward([runner.allocate()], [prompt], "all", hidden="all")

    grouped = prefill()
    monkeypatch.setattr(runtime, "REPEATS_KV_HEADS", {"cpu", "cuda"})
    if broken:
        monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda t, n, dim: t.repeat(1, n, 1, 1))
    repeated = prefill()
    same = all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(repeated, grouped))
    assert same != broken


def test_a_gpu_prefills_a_long_prompt_in_chunks(target, monkeypatch):
    """Without the CPU's attention kernel a long prompt is one masked call, whose scores grow with its length
    squared: a GPU runs it in PREFILL_CHUNK pieces, each after the ones before, with the rows of one call."""
    prompt = [(7 * i + 3) % 60 + 1 for i in range(100)]
    whole = ModelRunner(target.model, 1, 128, fixed_shapes=False)
    assert not whole.packs_any_width  # the tiny float model has no attention kernel: one call here
    expected = whole.forward([whole.allocate()], [prompt], "all", hidden="all")
    monkeypatch.setattr(runner_module, "PREFILL_CHUNK", 32)
    monkeypatch.setattr(runner_module, "CHUNKS_EVERY_PROMPT", {"cpu", "cuda"})
    runner, widths = ModelRunner(target.model, 1, 128, fixed_shapes=False), []
    call = runner._forward_call
    monkeypatch.setattr(
        runner, "_forward_call", lambda slots, inputs, *a: widths.append(len(inputs[0])) or call(slots, inputs, *a)
    )
    got = runner.forward([runner.allocate()], [prompt], "all", hidden="all")
    assert widths == [32, 32, 32, 4]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
