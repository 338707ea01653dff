"""Seed 003's claim, measured: does a verify of k + 1 tokens cost a mixture of experts more than a dense model of
the same active parameters? For each GGUF file: T(t)/T(1) of a forward over t tokens after 128 cached ones
(one sequence), the distinct experts such a forward reads per layer (its rows routed as the model routes the
continuation of real text), and the ceiling of speculation those costs allow (max over t of t T(1)/T(t): every
draft accepted, drafting free).

    python tools/moe_verify_cost.py MOE.gguf DENSE.gguf [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdecode.bench.datasets import humaneval_prompts
from specdecode.bench.results import describe_machine, machine_info
from specdecode.executor.runner import ModelRunner
from specdecode.models.layers import SparseMoE
from specdecode.models.loader import load_model

WIDTHS = (1, 2, 3, 4, 5, 6, 8)


def verify_calls(loaded, width: int, text: str) -> tuple[float, float | None]:
    """(Median seconds, mean distinct experts read per layer) of forwards over `width` consecutive tokens of
    real text, one sequence, after 128 tokens of it and through 256 more (the routing of real text: rows of
    one token repeated would share their experts)."""
    layers = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
    counts: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: counts.append(m.experts_read(args[0]))) for m in layers]
    times = []
    try:
        ids = loaded.tokenizer.encode(text)[: 128 + 256]
        runner = ModelRunner(loaded.model, 1, len(ids) + 1)
        slot = runner.allocate()
        runner.forward([slot], [ids[:128]], "last")
        runner.commit(slot, 128)
        del counts[:]  # the prefill's
        for start in range(128, len(ids) - width + 1, width):
            began = time.perf_counter()
            runner.forward([slot], [ids[start : start + width]], "all")
            times.append(time.perf_counter() - began)
            runner.commit(slot, start + width)
    finally:
        for h in hooks:
            h.remove()
    # the hooks' routing in PyTorch is timed with the calls: the timing runs again without them
    runner = ModelRunner(loaded.model, 1, len(ids) + 1)
    slot, times = runner.allocate(), []
    runner.forward([slot], [ids[:128]], "last")
    runner.commit(slot, 128)
    for start in range(128, len(ids) - width + 1, width):
        began = time.perf_counter()
        runner.forward([slot], [ids[start : start + width]], "all")
        times.append(time.perf_counter() - began)
        runner.commit(slot, start + width)
    return statistics.median(times), (sum(counts) / len(counts) if counts else None)


def measure(path: str, text: str) -> dict:
    loaded = load_model(path, progress=False)
    calls = {t: verify_calls(loaded, t, text) for t in WIDTHS}
    ratio = {t: calls[t][0] / calls[1][0] for t in WIDTHS}
    cfg = loaded.config
    return {
        "model": path,
        "experts": cfg.num_experts,
        "experts_per_token": cfg.experts_per_token,
        "active_layer_parameters": cfg.layer_parameters,
        "t1_ms": 1000 * calls[1][0],
        "cost_ratio": ratio,
        "experts_read_per_layer": {t: calls[t][1] for t in WIDTHS},
        "ceiling": max(t / ratio[t] for t in WIDTHS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out")
    args = parser.parse_args()
    text = "\n".join(humaneval_prompts(10))
    print(describe_machine(machine_info()))
    rows = [measure(m, text) for m in args.models]
    print(f"{'model':<44}{'T(1) ms':>9}" + "".join(f"{f'T({t})/T(1)':>12}" for t in WIDTHS[1:]) + f"{'ceiling':>9}")
    for r in rows:
        print(
            f"{r['model'].rsplit('/', 1)[-1]:<44}{r['t1_ms']:>9.2f}"
            + "".join(f"{r['cost_ratio'][t]:>12.2f}" for t in WIDTHS[1:])
            + f"{r['ceiling']:>8.2f}x"
        )
        if r["experts"]:
            print(
                f"{'  distinct experts read per layer':<53}"
                + "".join(f"{r['experts_read_per_layer'][t]:>12.2f}" for t in WIDTHS[1:])
                + f"   (of {r['experts']}, {r['experts_per_token']} per token)"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
