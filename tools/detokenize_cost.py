"""A sequence's per-token text work: appending tokens and growing its text, by the tokenizers library's incremental
decoder (what a Rust tokenizer gets) against window decodes through transformers (what others get), on the bundled
target's tokenizer over Shakespeare's sonnets. Best of three runs over 4,000 tokens.

    PYTHONPATH=src python tools/detokenize_cost.py [--tokens-a-step 1 3]
"""

from __future__ import annotations

import argparse
import os
import time

from specdecode.engine.sequence import Sequence
from specdecode.models.loader import load_tokenizer
from specdecode.sampling import SamplingParams

SONNETS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "sonnets.txt")


class WindowOnly:
    """The tokenizer without its incremental decoder: the sequence decodes windows."""

    def __init__(self, tokenizer):
        self.eos_token_ids, self.decode = tokenizer.eos_token_ids, tokenizer.decode


def seconds_a_token(tokenizer, ids: list[int], step: int) -> tuple[float, str]:
    best, text = float("inf"), ""
    for _ in range(3):
        seq = Sequence([1, 2], SamplingParams(max_tokens=10**6, ignore_eos=True), None)
        start = time.perf_counter()
        for i in range(0, len(ids), step):
            seq.append(ids[i : i + step], None, tokenizer, 10**7)
        best, text = min(best, time.perf_counter() - start), seq.text
    return best / len(ids), text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens-a-step", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    tokenizer = load_tokenizer("qwen2.5-coder-1.5b")
    ids = tokenizer.encode(open(SONNETS, encoding="utf-8").read()[:30000])[:4000]
    whole = tokenizer.decode(ids)
    for step in args.tokens_a_step:
        windows, text_w = seconds_a_token(WindowOnly(tokenizer), ids, step)
        streamed, text_s = seconds_a_token(tokenizer, ids, step)
        assert text_w == text_s == whole, "the incremental text differs from the whole decode"
        print(
            f"{step} token(s) a step: incremental decoder {streamed * 1e6:.2f} us a token, window decodes "
            f"{windows * 1e6:.2f} us ({windows / streamed:.1f}x)"
        )


if __name__ == "__main__":
    main()
