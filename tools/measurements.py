"""Write docs/measurements.md, the current tables, from the runs' JSON in docs/bench/ (the runs before them, with
their narrative, are in docs/measurements-archive.md).

    python tools/measurements.py
"""

from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
BENCH = DOCS / "bench"

# Batch 1 beside llama.cpp, by machine: (name, date, JSON); the README's table shows the first five
BATCH_1 = [
    ("Zen 5", "2026-12-06", "latency-humaneval-head-zen5.json"),
    ("Zen 2, AVX2 only (AMD EPYC family 23 model 49)", "2026-11-27", "latency-humaneval-gpuhead-zen2.json"),
    ("Ice Lake (Intel Xeon, family 6 model 106)", "2026-11-24", "latency-humaneval-avx512.json"),
    ("Zen 4", "2026-12-03", "latency-humaneval-zen4-one-call.json"),
    ("Xeon AMX (Intel Xeon, family 6 model 167)", "2026-12-07", "latency-humaneval-head-xeon-amx.json"),
    ("Zen 3, AVX2 only (AMD EPYC family 25 model 1)", "2026-11-28", "latency-humaneval-zen3.json"),
    (
        "Zen 3 again, plain and n-gram, the model file already on disk (the run above read it just assembled)",
        "2026-11-28",
        "latency-humaneval-zen3-plain-again.json",
    ),
    ("Zen 5 again, right after the first run", "2026-12-06", "latency-humaneval-head-zen5-again.json"),
]
UNDER_LOAD = [
    ("Zen 5, the head, beside llama-server", "2026-12-06", "concurrency-humaneval-head-llama-server-zen5.json"),
    ("Xeon AMX, the head", "2026-12-02", "concurrency-humaneval-head-xeon-amx-row-blocks.json"),
    ("Zen 5, the head", "2026-12-05", "concurrency-humaneval-head-zen5.json"),
]
CONTEXT = ("Zen 5", "2026-11-28", [f"context-stdlib-{n}-read-ahead-zen5.json" for n in (1024, 4096, 16384, 32000)])

HEADER = """# Measurements: the current tables

Written by `python tools/measurements.py` from the runs' JSON in [bench/](bench/) (a test checks that this file is
what the script writes). Each table names its machine, the command that made it and the run's files; compare rows of
one run, not runs (the hosts' speed drifts, ±5% within a run and ~20% between runs). Every host is a 2-core cloud VM
with torch 2.13.0 CPU on 2 threads. The runs before these, the studies behind each design and their narrative are in
[measurements-archive.md](measurements-archive.md); why each design was kept is in [decisions.md](decisions.md).
"""


def load(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def machine(meta: dict) -> str:
    m = meta.get("machine", {})
    flags = " ".join(m.get("cpu_flags", []))
    return f"{m.get('cpu', '?')}, `lscpu` flags {flags}; {m.get('kernels', 'kernels not recorded')}"


def fmt(value, places: int = 2) -> str:
    return "-" if value is None else f"{value:.{places}f}"


def batch_1_section(name: str, date: str, file: str) -> list[str]:
    run = load(file)
    rows = {r["config"]: r for r in run["results"]}
    reference = rows["llama.cpp: plain (mean)"]["tokens_per_s"]
    lines = [
        f"### {name}, {date}",
        "",
        f"{machine(run['meta'])}. `{run['meta']['command']}` ([json](bench/{file}))",
        "",
        "| config | tok/s | × llama.cpp plain | α | τ | output equal to plain |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for config, r in rows.items():
        equal = {True: "yes", False: "no"}.get(r.get("identical_to_plain"), "-")
        lines.append(
            f"| {config} | {fmt(r['tokens_per_s'])} | {fmt(r['tokens_per_s'] / reference)} | "
            f"{fmt(r.get('acceptance_rate'))} | {fmt(r.get('mean_accepted_length'))} | {equal} |"
        )
    return lines + [""]


def under_load_section(name: str, date: str, file: str) -> list[str]:
    run = load(file)
    results = run["results"]
    configs = list(dict.fromkeys(r["config"] for r in results))
    levels = sorted({r["concurrency"] for r in results})
    rate = {(r["config"], r["concurrency"]): r["output_throughput"] for r in results}
    lines = [
        f"## Through the server, by concurrency ({name}, {date})",
        "",
        f"Output tokens/s, {run['meta']['max_tokens']} new tokens a request, HumanEval, drafts by "
        f"{run['meta']['draft']}; ratio to our plain decoding at the same concurrency. {machine(run['meta'])}. "
        f"`{run['meta']['command']}` ([json](bench/{file}))",
        "",
        "| config | " + " | ".join(f"{c} clients" for c in levels) + " |",
        "|---|" + "---:|" * len(levels),
    ]
    for config in configs:
        cells = [
            f"{rate[config, c]:.2f} ({rate[config, c] / rate['plain', c]:.2f}×)" if (config, c) in rate else "-"
            for c in levels
        ]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines + [""]


def context_section() -> list[str]:
    name, date, files = CONTEXT
    runs = [load(f) for f in files]
    lengths = [int(r["meta"]["dataset"].partition(":")[2]) for r in runs]
    configs = list(dict.fromkeys(row["config"] for run in runs for row in run["results"]))
    lines = [
        f"## Speculation against context length ({name}, {date})",
        "",
        f"Decode tok/s after a prompt of standard-library source, 256 tokens, the 1.5B with its head; ratio to "
        f"plain decoding at the same length. {machine(runs[0]['meta'])}. `{runs[0]['meta']['command']}`, one "
        "file per length (" + ", ".join(f"[{n}](bench/{f})" for n, f in zip(lengths, files)) + ")",
        "",
        "| config | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for config in configs:
        cells = []
        for run in runs:
            rows = {r["config"]: r["tokens_per_s"] for r in run["results"]}
            plain = next(v for k, v in rows.items() if k.endswith("plain"))
            cells.append(f"{rows[config]:.1f} ({rows[config] / plain:.2f}×)" if config in rows else "-")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return lines + [""]


def render() -> str:
    lines = [
        HEADER,
        "## Batch size 1 beside llama.cpp",
        "",
        "HumanEval, greedy; decoding rate (tokens after the first over the time after it); each ratio to "
        "llama.cpp's plain decoding in the same run (the mean of its runs before and after ours).",
        "",
    ]
    for name, date, file in BATCH_1:
        lines += batch_1_section(name, date, file)
    lines += [line for run in UNDER_LOAD for line in under_load_section(*run)] + context_section()
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    (DOCS / "measurements.md").write_text(render())
