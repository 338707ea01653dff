"""Exact and sampled distributions of short generations, for the losslessness tests of whole requests:
the exact joint P(t1, ..., tn) of plain decoding is enumerated from fresh forwards over every prefix,
and speculative samples are compared with it by a chi-square test."""

from __future__ import annotations

import os

import torch
from scipy.stats import chisquare

from specdecode import LLM
from specdecode.executor.runner import ModelRunner
from specdecode.sampling import GrammarMatcher, logits_to_probs, process_logits

# Every statistical test draws its random inputs and samples from seeds offset by this, fixed per run (never
# Python's salted hash); `make chi2-seeds` runs them under 20 offsets to show they are not flaky.
SEED = int(os.environ.get("SPECDECODE_TEST_SEED", "0"))


# A correct sampler passes a chi-square test when p > PASS_P; every broken variant must give p < 1e-6, far
# below it. 1e-3 would make about 500 checks over 20 seeds raise a false alarm every other run.
PASS_P = 1e-5


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 1_000_003 + seed)


def exact_joint(model, prompt: list[int], params) -> dict[tuple, float]:
    """P(output) of plain decoding, each next-token distribution processed by the same definitions (and
    masked by the request's grammar, if any); a sequence that ends on EOS early keeps its shorter tuple."""
    runner = ModelRunner(model.model, 1, 64)
    eos = model.tokenizer.eos_token_ids
    vocab = model.config.vocab_size

    def next_probs(prefix):
        slot = runner.allocate()
        logits = runner.forward([slot], [prompt + list(prefix)], "last")
        runner.free(slot)
        logits = process_logits(logits, params, prompt, list(prefix), (), eos)
        if params.structured_output is not None:
            grammar = GrammarMatcher.compile(params.structured_output, model.tokenizer, vocab)
            grammar.advance(list(prefix))
            logits = grammar.mask_rows(logits, [])
        return logits_to_probs(logits, params)[0].tolist()

    joint: dict[tuple, float] = {}

    def walk(prefix, p):
        if len(prefix) == params.max_tokens or (prefix and prefix[-1] in eos):
            joint[prefix] = joint.get(prefix, 0.0) + p
            return
        for token, q in enumerate(next_probs(prefix)):
            if q > 0:
                walk(prefix + (token,), p * q)

    walk((), 1.0)
    return joint


def sampled_joint(
    target,
    draft,
    prompt,
    params,
    samples: int,
    k: int = 2,
    draft_confidence: float = 0.0,
    with_drafts_per_step: bool = False,
    speculative_model: str | None = None,
) -> tuple:
    """Counts of each output over `samples` speculative generations (k drafts per step, fewer where the
    draft stops at `draft_confidence`), the acceptance rate they had and, if asked, the mean number of
    tokens drafted per sequence and step."""
    torch.manual_seed(SEED)
    llm = LLM(
        target=target,
        draft=draft,
        speculative_model=speculative_model,
        num_speculative_tokens=k,
        max_model_len=256,
        max_num_seqs=128,
        speculation_policy="fixed",
        draft_confidence=draft_confidence,
    )
    outs = llm.generate([prompt] * (samples // params.n), params)
    counts: dict[tuple, int] = {}
    for out in outs:
        for o in out.outputs:
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    acceptance = sum(o.spec["num_accepted_tokens"] for o in outs) / max(1, drafted)
    if with_drafts_per_step:
        return counts, acceptance, drafted / max(1, sum(o.spec["num_spec_steps"] for o in outs))
    return counts, acceptance


def chi2_pvalue(counts: dict[tuple, int], joint: dict[tuple, float]) -> float:
    """Chi-square p-value of the sampled outputs against the exact joint (cells expected below 5 pooled);
    0 if any sampled output has probability 0 under the processed target."""
    total = sum(counts.values())
    if not set(counts) <= set(joint):
        return 0.0
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * total >= 5]
    rest = [c for c in cells if joint[c] * total < 5]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in rest)]
    expected = [joint[c] * total for c in big] + [sum(joint[c] for c in rest) * total]
    expected = [e * total / sum(expected) for e in expected]  # float rounding: the sums must agree exactly
    return chisquare(observed, expected).pvalue
