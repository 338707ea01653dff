"""The engine's own time a step, where forwards cost next to nothing: the adaptive policy beside plain decoding.

Tiny random models at fixed shapes (the forwards CUDA graphs replay, run here without capture), so that a step is
mostly the host's work, as on a GPU, where a step of the 1.5B at 64 sequences takes ~8 ms and issue 51 asks the
adaptive policy for 0.98x plain. The draft is never accepted (its LM head's rows are shuffled), so the policy drafts
nothing but its probes (docs/decisions.md#probes-budget-start-up-allowance-and-gate), and what separates a plain
step of the two engines is its bookkeeping. Per engine: the median of its steps that decode without drafts, and of
their host time (the step less its target forward, which a GPU replays), beside its rate (the probes in it). Runs
alternate; rates are the best of `--repeats`.

    PYTHONPATH=src python tools/host_overhead.py [--batches 1 8 32 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

os.environ["SMOKE"] = "1"  # cuda_check's tiny shapes
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from cuda_check import engine, generate, random_model  # noqa: E402

from specdecode.executor import runner  # noqa: E402


def never_accepted(draft):
    """The draft with its LM head's rows shuffled: its drafts are another token's."""
    weight = draft.model.embed_tokens.weight
    order = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(0))
    draft.model.lm_head.weight = torch.nn.Parameter(weight[order].clone(), requires_grad=False)
    return draft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner.fixed_shapes_by_default = lambda model: True  # every runner at bucket shapes, as on a GPU
    target, draft = random_model("target", 0), never_accepted(random_model("draft", 1))
    engines = {
        "plain": engine(target, num_speculative_tokens=0),
        "adaptive": engine(target, draft, num_speculative_tokens=4),
    }
    steps = {name: timed_steps(llm) for name, llm in engines.items()}
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    for batch in args.batches:
        best, spec = {name: 0.0 for name in engines}, None
        for seconds in steps.values():
            seconds.clear()
        for _ in range(args.repeats):
            for name, llm in engines.items():
                rate, _, first = generate(llm, batch, args.tokens)
                best[name] = max(best[name], rate)
                spec = first if name == "adaptive" else spec
        host = {name: statistics.median(s - f for s, f in seconds) * 1e6 for name, seconds in steps.items()}
        whole = {name: statistics.median(s for s, _ in seconds) * 1e3 for name, seconds in steps.items()}
        print(
            f"batch {batch:3d}: a step without drafts plain {whole['plain']:.3f} ms (host {host['plain']:.0f} us), "
            f"adaptive {whole['adaptive']:.3f} ms (host {host['adaptive']:.0f} us); rates {best['plain']:8.1f} / "
            f"{best['adaptive']:8.1f} tok/s = {best['adaptive'] / best['plain']:.3f}x ({spec.get('num_spec_steps')} "
            f"of {spec.get('num_steps')} steps probed)",
            flush=True,
        )


def timed_steps(llm) -> list[tuple[float, float]]:
    """(seconds, of which in target forwards) of each engine step that decoded without drafts, with no prompt waiting
    or being prefilled (appended as the engine runs): the rest is the host's work, which a GPU's replay leaves."""
    seconds, engine, forward_seconds = [], llm.engine, [0.0]
    step, forward = engine.step, engine.runner.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        forward_seconds[0] += time.perf_counter() - start
        return out

    def timed(*args, **kwargs):
        decoding_only, forward_seconds[0] = not (engine.waiting or engine.prefilling), 0.0
        start = time.perf_counter()
        out = step(*args, **kwargs)
        if decoding_only and out.counters.num_steps and not out.counters.num_draft_tokens:
            seconds.append((time.perf_counter() - start, forward_seconds[0]))
        return out

    engine.step, engine.runner.forward = timed, timed_forward
    return seconds


if __name__ == "__main__":
    main()
