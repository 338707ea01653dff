"""A new proposer is one class plus one `register_proposer` line: this toy drafts from what the target
emitted last step (its feedback, hidden states included) and runs through `LLM` and the server."""

import openai
import pytest
import torch
from conftest import LocalServer

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.proposers import DraftBatch, Proposer, proposer_names, register_proposer, unregister_proposer
from specdecode.server.api import build_app
from specdecode.server.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class RepeatLastProposer(Proposer):
    """Guesses that the target's last emitted token repeats. It asks for hidden states only to show they
    arrive: one row per emitted token, from the position whose logits chose it."""

    wants_hidden_states = True

    def __init__(self, setup):
        self.target = setup.target.model
        self.feedback_seen = []

    def propose(self, seqs, ks, feedback):
        self.feedback_seen.extend(f for f, k in zip(feedback, ks) if k)
        return DraftBatch([[f.tokens[-1]] * k if k else [] for f, k in zip(feedback, ks)], [None] * len(seqs))


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    register_proposer("repeat-last", RepeatLastProposer)  # the one registry line
    yield
    unregister_proposer("repeat-last")  # a test's plug-in does not outlive its module


def test_a_kind_registered_for_a_while_is_gone_after_unregistering(target):
    register_proposer("for-a-while", RepeatLastProposer)
    assert "for-a-while" in proposer_names()
    unregister_proposer("for-a-while")
    assert "for-a-while" not in proposer_names()
    with pytest.raises(SpecDecodeError, match="for-a-while"):  # now names a draft model that does not exist
        LLM(target=target, speculative_model="for-a-while", num_speculative_tokens=3, max_model_len=256)
    with pytest.raises(KeyError, match="no proposer kind 'for-a-while'"):
        unregister_proposer("for-a-while")


def _plain(target, prompts):
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_a_registered_proposer_runs_through_llm_and_stays_lossless(target):
    prompts = ["aaaaaaaa", "hello world"]
    llm = LLM(
        target=target,
        speculative_model="repeat-last",
        num_speculative_tokens=3,
        max_model_len=256,
        speculation_policy="fixed",
    )
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _plain(target, prompts)
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 0
    proposer = llm.engine.proposer
    assert isinstance(proposer, RepeatLastProposer) and proposer.feedback_seen


def test_feedback_hidden_states_are_the_rows_that_chose_each_token(target):
    llm = LLM(
        target=target,
        speculative_model="repeat-last",
        num_speculative_tokens=3,
        max_model_len=256,
        speculation_policy="fixed",
    )
    llm.generate(["abcabcabc"], GREEDY)
    model = llm.engine.proposer.target
    prompt_len = len(target.tokenizer.encode("abcabcabc"))
    for fb in llm.engine.proposer.feedback_seen:
        rows = len(fb.tokens) + (prompt_len - 1 if fb.start == 0 else 0)  # after prefill: the prompt's rows too
        assert fb.hidden.shape == (rows, target.config.hidden_size)
        with torch.inference_mode():  # greedy: each of the last rows' own logits picks its token
            chosen = model.lm_head(model.norm(fb.hidden[-len(fb.tokens) :])).argmax(-1).tolist()
        assert chosen == fb.tokens


def test_a_registered_proposer_serves_through_the_openai_client(target):
    llm = LLM(
        target=target,
        speculative_model="repeat-last",
        num_speculative_tokens=3,
        max_model_len=256,
        max_num_seqs=4,
        speculation_policy="fixed",
    )
    with LocalServer(build_app(AsyncEngine(llm.engine), "tiny", None)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(
            model="tiny", prompt="aaaaaaaa", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
    assert r.choices[0].text == target.tokenizer.decode(_plain(target, ["aaaaaaaa"])[0])
    assert r.usage.model_extra["speculation"]["num_draft_tokens"] > 0


def test_an_unknown_proposer_kind_is_a_model_name_and_fails_clearly(target):
    with pytest.raises(Exception, match="no-such-proposer"):
        LLM(target=target, speculative_model="no-such-proposer", num_speculative_tokens=3, max_model_len=256)
