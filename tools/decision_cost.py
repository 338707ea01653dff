"""What one adaptive-policy decision costs on this CPU, per batch size: the policy alone, fed a GPU-like cost model
(a plain step of 4 ms, verify rows cheap) and a draft forward at a given fraction of a plain step. At 0.8 (the 0.5B
beside the 1.5B on a launch-bound GPU) drafting cannot pay and the decision is pure overhead on every step; at 0.1 it
pays. Prints the median and mean over 200 decisions (the mean carries the steps that work out whether drafting could
pay at all).

    python tools/decision_cost.py [--sizes 1 8 32 64] [--draft-fractions 0.8 0.1]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specdecode.engine.policy.adaptive import AdaptivePolicy  # noqa: E402

PLAIN, PER_ROW, CONTEXT = 4e-3, 3e-5, 300  # a plain step's seconds, each verify row's more, each sequence's tokens


def policy(draft_fraction: float) -> AdaptivePolicy:
    p = AdaptivePolicy(4)
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for rows in (batch, 2 * batch, 5 * batch):
            p.record_target_cost(batch, rows, PLAIN + PER_ROW * rows)
        p.record_draft_cost(batch, draft_fraction * (PLAIN + PER_ROW * batch))
    return p


def decision_seconds(draft_fraction: float, n: int, steps: int = 200) -> tuple[list[float], int]:
    """Each decision's seconds over `steps` steps at n sequences, and the tokens the last one drafts."""
    p, ids, seconds, ks = policy(draft_fraction), [f"r{i}" for i in range(n)], [], [0] * n
    for _ in range(steps):
        start = time.perf_counter()
        ks = p.decide(ids, [0] * n, [100] * n, None, True, [CONTEXT] * n).ks
        seconds.append(time.perf_counter() - start)
        drafted = draft_fraction * PLAIN if any(ks) else None
        p.observe_step(ks, PLAIN + PER_ROW * (n + sum(ks)), drafted, None, None, [CONTEXT] * n)
    return seconds, sum(ks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--draft-fractions", type=float, nargs="+", default=[0.8, 0.1])
    args = parser.parse_args()
    for fraction in args.draft_fractions:
        for n in args.sizes:
            seconds, drafted = decision_seconds(fraction, n)
            median, mean = statistics.median(seconds) * 1e6, statistics.mean(seconds) * 1e6
            print(
                f"draft {fraction:.1f} of a plain step, {n:3d} sequences: a decision {median:7.1f} us median, "
                f"{mean:7.1f} mean; the last drafts {drafted} tokens",
                flush=True,
            )


if __name__ == "__main__":
    main()
