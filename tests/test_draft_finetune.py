"""`specdecode distill --draft-model`: a small draft model fine-tuned on the target's own outputs, the
comparison for a draft head. Tiny models here: the fine-tuned draft must agree with the target more than
before, load as a draft from its folder, and draft what the target says."""

import json

import pytest
from conftest import VOCAB, random_hf_weights, tiny_config

from specdecode import LLM, SamplingParams
from specdecode.distill.draft_model import causal_lm, finetune_draft
from specdecode.distill.recipe import Recipe
from specdecode.errors import SpecDecodeError

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _hf_tokenizer(vocab: int):
    """A Hugging Face tokenizer with the test tokenizer's vocabulary (chr(32 + i) <-> i)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    table = {chr(32 + i): i for i in range(vocab)}
    eos = chr(32 + vocab - 1)  # every special token named, so that no tokenizer class adds its own
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(table, unk_token=" ")),
        eos_token=eos,
        unk_token=" ",
        pad_token=eos,
        bos_token=eos,
    )


def _draft_folder(path, seed: int = 123, vocab: int = VOCAB) -> str:
    """A random one-layer model as a Hugging Face checkpoint folder."""
    cfg = tiny_config(layers=1, vocab=vocab)
    causal_lm(cfg, random_hf_weights(cfg, seed)).save_pretrained(path, safe_serialization=True)
    _hf_tokenizer(vocab).save_pretrained(path)
    return str(path)


def _own_text(target, path) -> str:
    """The target's greedy continuations of some prompts, as a jsonl data source."""
    plain = LLM(target=target, num_speculative_tokens=0, max_model_len=256)
    outs = plain.generate(
        [[i, i + 1, (3 * i) % 60] for i in range(1, 49)], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    )
    path.write_text(
        "".join(
            json.dumps({"text": target.tokenizer.decode(o.prompt_token_ids + o.outputs[0].token_ids)}) + "\n"
            for o in outs
        )
    )
    return f"jsonl:{path}"


@pytest.fixture(scope="module")
def finetuned(target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finetune")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(tmp / "cache"))
        recipe = Recipe(
            sources=[_own_text(target, tmp / "own.jsonl")],
            tokens=4000,
            chunk=48,
            batch=8,
            finetune_steps=100,
            finetune_lr=3e-3,
        )
        draft = _draft_folder(tmp / "draft")
        summary = finetune_draft(target, draft, str(tmp / "tuned"), recipe, progress=False)
    return draft, str(tmp / "tuned"), summary


def test_the_finetuned_draft_agrees_with_the_target_far_more_than_before(finetuned):
    _, _, summary = finetuned
    assert summary["held_out_top1_after"] > summary["held_out_top1_before"] + 0.2, summary


def test_the_finetuned_folder_drafts_what_the_target_says_and_changes_nothing(target, finetuned):
    """Loaded by name like any draft: greedy output equals plain decoding's, and on a prompt it never saw
    its drafts are accepted far more often than the untrained draft's."""
    before, tuned, _ = finetuned
    unseen = [[50, 51, 27]]
    plain = LLM(target=target, num_speculative_tokens=0).generate(unseen, GREEDY)[0].outputs[0].token_ids
    rates = []
    for draft in (tuned, before):
        out = LLM(
            target=target, speculative_model=draft, num_speculative_tokens=4, speculation_policy="fixed"
        ).generate(unseen, GREEDY)[0]
        assert out.outputs[0].token_ids == plain
        rates.append(out.spec["acceptance_rate"])
    assert rates[0] > rates[1] + 0.15, rates


def test_a_draft_with_another_tokenizer_is_refused(target, tmp_path):
    with pytest.raises(SpecDecodeError, match="different vocabularies"):
        finetune_draft(target, _draft_folder(tmp_path / "other", vocab=VOCAB + 16), str(tmp_path / "out"))
