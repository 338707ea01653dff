"""Which drafter a command uses when none is named: `generate` and `serve` the bundled head for the bundled
target, suffix speculation for another target (no model to draft with; nothing beside a drafter unless
asked: `--prompt-lookup none` turns it off again); the
benchmarks' draft-model rows the bundled 0.5B; a named one always wins."""

import pytest

from specdecode.bench.latency import draft_model_name
from specdecode.cli import build_parser
from specdecode.config import DEFAULT_DRAFT, DEFAULT_HEAD
from specdecode.server.serve_cmd import llm_options


@pytest.mark.parametrize(
    "flags, expected, lookup",
    [
        ([], DEFAULT_HEAD, None),
        (["--prompt-lookup", "suffix"], DEFAULT_HEAD, "suffix"),
        (["--prompt-lookup", "suffix", "--prompt-lookup", "none"], DEFAULT_HEAD, None),
        (["--draft", "ngram"], "ngram", None),
        (["--model", "other.gguf"], "suffix", None),
        (["-k", "0"], None, None),
    ],
)
def test_serve_drafts_with_the_bundled_head_unless_told_otherwise(flags, expected, lookup):
    args = build_parser().parse_args(["serve", *flags])
    assert (llm_options(args)["speculative_model"], llm_options(args)["prompt_lookup"]) == (expected, lookup)


def test_the_benchmarks_draft_model_rows_keep_the_bundled_draft_model():
    assert draft_model_name(build_parser().parse_args(["bench", "latency"])) == DEFAULT_DRAFT
