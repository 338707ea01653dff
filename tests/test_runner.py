"""The executor seam: a slot's KV entries become context only when committed, never past what a forward
wrote; rollback moves the pointer back; hidden states come with the logits of the same rows."""
import pytest
import torch

from specdecode.executor.runner import ModelRunner


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


def test_hidden_states_are_the_rows_the_logits_come_from(target):
    model = target.model
    runner = ModelRunner(model, 2, 32)
    slots = [runner.allocate(), runner.allocate()]
    logits, hidden = runner.forward(slots, [[1, 2, 3], [4, 5]], "all", hidden=True)
    assert hidden.shape == (5, model.cfg.hidden_size)
    torch.testing.assert_close(logits, model.lm_head(model.norm(hidden)).float())
