"""Speculation against context length: the `bench latency` results of stdlib:LEN prompts, one file per length,
as one table (decode tok/s per configuration, its ratio to plain decoding, the KV bytes a plain step reads
beside the weights) and a plot of each configuration's speedup against the context.

    for n in 1024 4096 16384 32000; do specdecode bench latency --dataset stdlib:$n --num-prompts 1 \\
        --max-tokens 256 -k 3 --draft head:qwen2.5-coder-1.5b --no-ngram --out results/context-$n.json; done
    python tools/context_study.py results/context-*.json --out docs/bench
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.plots import label_axes, pyplot, save
from specdecode.bench.results import describe_machine

KV_BYTES_PER_TOKEN = 2 * 28 * 2 * 128 * 2  # the 1.5B: keys and values, 28 layers, 2 KV heads of 128, float16


def load(paths: list[str]) -> dict[int, dict]:
    """context length -> {"meta", "rows": {config: row}}, the configuration named without its backend."""
    runs = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        length = int(data["meta"]["dataset"].partition(":")[2])
        rows = {r["config"].partition(": ")[2]: r for r in data["results"]}
        runs[length] = {"meta": data["meta"], "rows": rows}
    return dict(sorted(runs.items()))


def table(runs: dict[int, dict]) -> str:
    configs = list(next(iter(runs.values()))["rows"])
    lines = [
        "| context | KV a plain step reads | time to first token, plain | " + " | ".join(configs) + " |",
        "|---:|---:|---:|" + "---:|" * len(configs),
    ]
    for length, run in runs.items():
        rows, plain = run["rows"], run["rows"]["plain"]
        cells = [_cell(rows.get(c), plain["tokens_per_s"], c == "plain") for c in configs]
        lines.append(
            f"| {length:,} | {length * KV_BYTES_PER_TOKEN / 2**20:.0f} MiB | "
            f"{plain['mean_ttft_ms'] / 1e3:.1f} s | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _cell(row: dict | None, plain: float, is_plain: bool) -> str:
    if row is None:
        return "-"
    tok_s = row["tokens_per_s"]
    return f"{tok_s:.1f}" if is_plain else f"{tok_s:.1f} ({tok_s / plain:.2f}×)"


def plot(runs: dict[int, dict], out: Path) -> str:
    """Each configuration's decode speedup over plain decoding against the context."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = list(runs)
    for config in (c for c in next(iter(runs.values()))["rows"] if c != "plain"):
        points = [
            (n, run["rows"][config]["tokens_per_s"] / run["rows"]["plain"]["tokens_per_s"])
            for n, run in runs.items()
            if config in run["rows"]
        ]
        ax.plot(*zip(*points), "-", marker="o", label=config)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    label_axes(ax, "tokens of context (standard-library source)", "decode speedup over plain", legend_size=7)
    return save(fig, out, "context-study")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    runs = load(args.results)
    print(describe_machine(next(iter(runs.values()))["meta"]["machine"]))
    print(table(runs))
    print(f"plot: {plot(runs, Path(args.out))}")


if __name__ == "__main__":
    main()
