"""What drawing a token and top-p cost per call on this CPU, beside the torch-only way, at the target's vocabulary:
`sample_rows` (one cumulative sum per row) against `torch.multinomial` (a random number per token), and `nucleus`
(top-p among the 256 first-ranked, whole-row sort only where the nucleus is wider) against sorting every row.
Model-like rows are peaked (20 tokens hold nearly all the mass); flat rows show the fallback's cost.

    python tools/sampling_cost.py [--vocab 151936] [--rows 1 4 32] [--repeats 15]
"""

from __future__ import annotations

import argparse

import torch

from specdecode.bench.results import describe_machine, machine_info, median_seconds
from specdecode.sampling import sample_rows
from specdecode.sampling.probs import nucleus


def top_p_by_sorting(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    ranked, order = probs.sort(-1, descending=True)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (ranked.cumsum(-1) - ranked) >= top_p)
    kept = probs.masked_fill(drop, 0)
    return kept / kept.sum(-1, keepdim=True)


def rows_of(kind: str, rows: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab) * 2
    if kind == "peaked":
        logits.scatter_add_(1, torch.randint(0, vocab, (rows, 20)), torch.full((rows, 20), 16.0))
    return (logits / 0.8).softmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{describe_machine(machine_info())}; vocabulary {args.vocab}; median of {args.repeats} calls")
    cases = [(kind, rows, rows_of(kind, rows, args.vocab)) for kind in ("peaked", "flat") for rows in args.rows]
    for _ in range(2):  # the first round only warms the allocator: its first large buffers fault their pages in
        timed = [(kind, rows, time_case(probs, args.repeats)) for kind, rows, probs in cases]
    for kind, rows, (multinomial, ours, sorting, top_p) in timed:
        print(
            f"{kind} rows, {rows:>2}: draw {ours:.2f} ms (torch.multinomial {multinomial:.2f}: "
            f"{multinomial / ours:.1f}×); top-p 0.95 {top_p:.2f} ms (sorting every row {sorting:.2f}: "
            f"{sorting / top_p:.1f}×)",
            flush=True,
        )


def time_case(probs: torch.Tensor, repeats: int) -> tuple[float, ...]:
    """Milliseconds: torch.multinomial, sample_rows, top-p by sorting every row, nucleus."""
    calls = (
        lambda: torch.multinomial(probs, 1),
        lambda: sample_rows(probs),
        lambda: top_p_by_sorting(probs, 0.95),
        lambda: nucleus(probs, 0.95),
    )
    return tuple(median_seconds(call, repeats) * 1e3 for call in calls)


if __name__ == "__main__":
    main()
