"""What one adaptive-policy decision costs on this CPU, per batch size: the policy alone, fed a GPU-like cost model
(a plain step of 4 ms, verify rows cheap, each step's time 2% off at random) and a draft forward at a given fraction
of a plain step, its drafts accepted token by token with a given chance (each outcome fed back, as the engine does).
At 0.8 (the 0.5B beside the 1.5B on a launch-bound GPU) drafting cannot pay and the decision is pure overhead on every
step; at 0.1 good drafts pay, and whether these do depends on their acceptance: the policy prices whole allocations.
Prints the median and mean over 200 decisions (the mean carries the steps that work out whether drafting could pay at
all), and the median of the feedback that follows each (outcomes and the step's cost); each step's least time over
identical runs.

    python tools/decision_cost.py [--sizes 1 8 32 64] [--draft-fractions 0.8 0.1] [--acceptance 0.3 0.8]
"""

import argparse
import random
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


def accepted(k: int, acceptance: float, rng: random.Random) -> int:
    """Of k drafts each accepted with this chance, how many are before the first rejection."""
    return next((j for j in range(k) if rng.random() >= acceptance), k)


def policy_seconds(draft_fraction: float, acceptance: float, n: int, steps: int = 200) -> tuple[list, list, int]:
    """Over `steps` steps at n sequences: each decision's seconds, each step's feedback's (every sequence's outcome
    and the step's cost, as the engine reports them), and the tokens the last decision drafts."""
    p, ids, decisions, feedback, ks = policy(draft_fraction), [f"r{i}" for i in range(n)], [], [], [0] * n
    rng = random.Random(0)
    jitter = [1 + 0.02 * rng.gauss(0, 1) for _ in range(steps)]  # steps vary as measured ones do
    for step in range(steps):
        start = time.perf_counter()
        ks = p.decide(ids, [0] * n, [100] * n, None, True, [CONTEXT] * n).ks
        decided = time.perf_counter()
        outcomes = [accepted(k, acceptance, rng) for k in ks]
        drafted = draft_fraction * PLAIN if any(ks) else None
        fed = time.perf_counter()
        for rid, k, hits in zip(ids, ks, outcomes):
            p.observe_acceptance(rid, k, hits, k)
        p.observe_step(ks, (PLAIN + PER_ROW * (n + sum(ks))) * jitter[step], drafted, None, None, [CONTEXT] * n)
        decisions.append(decided - start)
        feedback.append(time.perf_counter() - fed)
    return decisions, feedback, sum(ks)


def least(runs: list[list[float]]) -> list[float]:
    """Per step, the least of identical runs' seconds: a shared CPU's stalls left out."""
    return [min(step) for step in zip(*runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--draft-fractions", type=float, nargs="+", default=[0.8, 0.1])
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.3, 0.8])
    parser.add_argument("--repeats", type=int, default=5, help="identical runs; each step's least time is kept")
    args = parser.parse_args()
    for fraction in args.draft_fractions:
        for acceptance in args.acceptance:
            for n in args.sizes:
                runs = [policy_seconds(fraction, acceptance, n) for _ in range(args.repeats)]
                decisions, feedback = least([r[0] for r in runs]), least([r[1] for r in runs])
                print(
                    f"draft {fraction:.1f} of a plain step, acceptance {acceptance:.1f}, {n:3d} sequences: a decision "
                    f"{statistics.median(decisions) * 1e6:6.1f} us median, {statistics.mean(decisions) * 1e6:6.1f} "
                    f"mean; its feedback {statistics.median(feedback) * 1e6:6.1f} us median; the last drafts "
                    f"{runs[0][2]} tokens",
                    flush=True,
                )


if __name__ == "__main__":
    main()
