"""Which drafter a command uses when none is named: `generate` and `serve` the bundled head for the bundled
target, the benchmarks' draft-model rows the bundled 0.5B, another target none; a named one always wins."""
import pytest

from specdecode.bench.latency import draft_model_name
from specdecode.cli import build_parser
from specdecode.config import DEFAULT_DRAFT, DEFAULT_HEAD
from specdecode.server.serve_cmd import llm_options


@pytest.mark.parametrize("flags, expected", [
    ([], DEFAULT_HEAD),
    (["--draft", "ngram"], "ngram"),
    (["--model", "other.gguf"], None),
    (["-k", "0"], None),
])
def test_serve_drafts_with_the_bundled_head_unless_told_otherwise(flags, expected):
    args = build_parser().parse_args(["serve", *flags])
    assert llm_options(args)["speculative_model"] == expected


def test_the_benchmarks_draft_model_rows_keep_the_bundled_draft_model():
    assert draft_model_name(build_parser().parse_args(["bench", "latency"])) == DEFAULT_DRAFT
