"""`specdecode bench report RESULTS_DIR`: read the JSON files the benchmarks wrote, draw the study's plots
(matplotlib, PNG) and write a Markdown report with the tables, the images and the answers they give."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..errors import SpecDecodeError
from .formatting import fmt, joined, markdown_heading, markdown_images, mean, ratio, yes_no
from .plots import by_config, label_axes, parity_line, plot_concurrency, pyplot, save
from .sweep_report import sweep_section


def load_results(folder: str | Path) -> dict[str, list[dict]]:
    """The benchmark files of a folder, by kind: `latency` (batch-1 k sweep), `concurrency` (server sweep),
    `sweep` (bench sweep), `plan` (the advisor) and `baseline` (transformers)."""
    kinds: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict):
            continue
        data["file"] = path.name
        kind = data.get("kind") or (data.get("meta") or {}).get("kind")
        if kind == "plan":
            kinds["plan"].append(data)
            continue
        rows = data.get("results")
        if not rows or not isinstance(rows, list):
            continue
        if kind in ("sweep", "baseline"):
            kinds[kind].append(data)
        elif "proposer" in rows[0] and "k" in rows[0]:
            kinds["latency"].append(data)
        elif "config" in rows[0] and "concurrency" in rows[0]:
            kinds["concurrency"].append(data)
    if not kinds:
        raise SpecDecodeError(f"no benchmark results (*.json from `specdecode bench ...`) in {folder}")
    return kinds


# ---- concurrency sweep ------------------------------------------------------------------------------------
def concurrency_table(rows: list[dict]) -> str:
    out = [
        "| config | concurrency | tok/s | vs plain | each round vs plain | TPOT ms (mean) | TPOT reduction | "
        "TTFT s (mean) | α | speculating |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config, series in by_config(rows).items():
        for r in series:
            rounds = joined(r.get("round_throughputs_vs_plain", [])) if config != "plain" else ""
            out.append(
                f"| {config} | {r['concurrency']} | {r['output_throughput']:.2f} | "
                f"{ratio(r.get('throughput_vs_plain'), missing='', sign='×')} | {rounds} | "
                f"{fmt(mean(r['tpot_s'], 1000), '.0f')} | "
                f"{ratio(r.get('tpot_reduction_vs_plain'), missing='', sign='×')} | "
                f"{fmt(mean(r['ttft_s']), '.2f')} | {fmt(r.get('acceptance_rate'), '.3f')} | "
                f"{fmt(r.get('speculating_fraction'), '.0%')} |"
            )
    return "\n".join(out)


def concurrency_findings(rows: list[dict]) -> list[str]:
    lines = by_config(rows)
    found = []
    fixed = lines.get("fixed", [])
    losing = [r["concurrency"] for r in fixed if r.get("throughput_vs_plain", 1) < 1]
    if fixed:
        found.append(
            f"Fixed-k speculation stops paying at concurrency {losing[0]} "
            f"({next(r for r in fixed if r['concurrency'] == losing[0])['throughput_vs_plain']:.2f}× plain)."
            if losing
            else "Fixed-k speculation paid at every concurrency measured."
        )
    adaptive = [r for r in lines.get("adaptive", []) if "throughput_vs_plain" in r]
    if adaptive:
        worst = min(adaptive, key=lambda r: r["throughput_vs_plain"])
        verdict = (
            "stays at or above plain decoding's throughput at every concurrency measured"
            if worst["throughput_vs_plain"] >= 1
            else "falls below plain decoding's throughput"
        )
        idle = ""
        if worst["throughput_vs_plain"] < 1 and worst.get("speculating_fraction") is not None:
            drafted = worst["speculating_fraction"]
            idle = (
                " where it drafted nothing: plain decoding's work, so the gap is between two server runs"
                if drafted == 0
                else f" where it drafted in {drafted:.0%} of its steps"
            )
        found.append(
            f"The adaptive policy {verdict} "
            f"(lowest: {worst['throughput_vs_plain']:.2f}× at concurrency {worst['concurrency']}{idle})."
        )
        one = next((r for r in adaptive if r["concurrency"] == 1), None)
        if one:
            found.append(
                f"At concurrency 1 the adaptive policy's TPOT is {one['tpot_reduction_vs_plain']:.2f}× "
                f"lower than plain decoding's."
            )
    return found


# ---- batch-1 latency sweep ----------------------------------------------------------------------------------
def plot_latency(rows: list[dict], out: Path) -> list[str]:
    plt = pyplot()
    spec = [r for r in rows if r["k"] > 0]
    by_proposer = defaultdict(list)
    for r in spec:
        by_proposer[r["config"].split()[0]].append(r)
    images = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, series in by_proposer.items():
        series.sort(key=lambda r: r["k"])
        ks = [r["k"] for r in series]
        ax1.plot(ks, [r["acceptance_rate"] for r in series], marker="o", label=name)
        ax2.plot(ks, [r["mean_accepted_length"] for r in series], marker="o", label=name)
    all_ks = sorted({r["k"] for r in spec})
    for ax, label in ((ax1, "acceptance rate α"), (ax2, "mean accepted length τ")):
        ax.set_xticks(all_ks)
        label_axes(ax, "k (draft tokens)", label)
    images.append(save(fig, out, "acceptance_vs_k.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, series in by_proposer.items():
        ax.plot([r["k"] for r in series], [r["speedup"] for r in series], marker="o", label=f"{name}: measured")
        predicted = [r for r in series if r.get("predicted_speedup")]
        if predicted:
            ax.plot(
                [r["k"] for r in predicted],
                [r["predicted_speedup"] for r in predicted],
                marker="x",
                linestyle=":",
                label=f"{name}: predicted (Leviathan)",
            )
    parity_line(ax)
    ax.set_xticks(all_ks)
    label_axes(ax, "k (draft tokens)", "speedup over plain decoding")
    images.append(save(fig, out, "speedup_vs_k.png"))
    return images


def latency_table(rows: list[dict]) -> str:
    out = [
        "| config | tok/s | speedup | α | τ | c | predicted | identical to plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['config']} | {r['tokens_per_s']:.2f} | {fmt(r.get('speedup'), '.2f')} | "
            f"{fmt(r.get('acceptance_rate'), '.3f')} | {fmt(r.get('mean_accepted_length'), '.2f')} | "
            f"{fmt(r.get('cost_ratio_c'), '.3f')} | {fmt(r.get('predicted_speedup'), '.2f')} | "
            f"{yes_no(r.get('identical_to_plain'))} |"
        )
    return "\n".join(out)


def latency_findings(rows: list[dict]) -> list[str]:
    spec = [r for r in rows if r["k"] > 0 and r.get("speedup")]
    if not spec:
        return []
    best = max(spec, key=lambda r: r["speedup"])
    found = [
        f"Best configuration at concurrency 1: {best['config']} ({best['tokens_per_s']:.2f} tok/s, "
        f"{best['speedup']:.2f}× plain)."
    ]
    ratios = [r["speedup"] / r["predicted_speedup"] for r in spec if r.get("predicted_speedup")]
    if ratios:
        found.append(
            f"Measured speedup is {min(ratios):.0%}–{max(ratios):.0%} of the Leviathan prediction "
            "from measured α and c."
        )
    if all(r.get("identical_to_plain") for r in spec):
        found.append("Every greedy speculative output was identical to plain decoding.")
    return found


def peer_findings(ours: list[dict], peers: list[dict]) -> list[str]:
    """Where llama.cpp ran beside us: our plain and best speculative speed against its plain decoding."""
    plain = next((r for r in peers if r["config"].endswith("(mean)")), None)
    if plain is None or not ours:
        return []
    best_peer = max((r for r in peers if r["k"] > 0), key=lambda r: r["tokens_per_s"], default=None)
    best = max(ours, key=lambda r: r["tokens_per_s"])
    own_plain = next((r for r in ours if r["k"] == 0), None)
    found = []
    if own_plain:
        found.append(
            f"Plain decoding: {own_plain['tokens_per_s'] / plain['tokens_per_s']:.2f}× llama.cpp's "
            f"({own_plain['tokens_per_s']:.2f} vs {plain['tokens_per_s']:.2f} tok/s)."
        )
    line = (
        f"Best of ours: {best['config']} at {best['tokens_per_s'] / plain['tokens_per_s']:.2f}× llama.cpp's plain "
        "decoding"
    )
    if best_peer:
        line += f"; llama.cpp's own best speculation: {best_peer['tokens_per_s'] / plain['tokens_per_s']:.2f}×"
    return found + [line + "."]


def matching_sweep_rows(meta: dict, sweeps: list[dict]) -> list[dict]:
    """specdecode's own cells measured like the baseline (HumanEval, batch 1, same prompts, tokens and k)."""
    out = []
    for data in sweeps:
        for r in data["results"]:
            if (
                r["dataset"] == "humaneval"
                and r["concurrency"] == 1
                and r["policy"] == "fixed"
                and not r["forced_accept"]
                and r["max_tokens"] == meta.get("max_tokens")
                and r["num_requests"] == meta.get("num_prompts")
                and r["k"] in (0, meta.get("k"))
                and r.get("speedup")
            ):
                out.append(
                    {
                        "config": f"specdecode {r['label']}",
                        "tokens_per_s": r["output_throughput"],
                        "speedup": r["speedup"],
                    }
                )
        if out:
            return out
    return out


def baseline_table(rows: list[dict]) -> str:
    out = ["| config | tok/s | speedup | identical to plain |", "|---|---:|---:|---|"]
    for r in rows:
        out.append(
            f"| {r['config']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f} | {yes_no(r.get('identical_to_plain'))} |"
        )
    return "\n".join(out)


# ---- the report -----------------------------------------------------------------------------------------------
def write_report(folder: str | Path, out: str | Path | None = None) -> Path:
    folder = Path(folder)
    out = Path(out) if out else folder
    out.mkdir(parents=True, exist_ok=True)
    kinds = load_results(folder)
    parts = ["# specdecode benchmark report", ""]
    findings: list[str] = []
    sections: list[str] = []
    for data in kinds.get("latency", []):
        rows = [r for r in data["results"] if r.get("backend") != "llama.cpp"]  # ours; the peer's rows follow
        peers = [r for r in data["results"] if r.get("backend") == "llama.cpp"]
        findings += latency_findings(rows) + peer_findings(rows, peers)
        images = plot_latency(rows, out)
        sections += (
            markdown_heading(f"Batch size 1: k sweep ({data['file']})", data["meta"])
            + [latency_table(rows + peers), ""]
            + markdown_images(images)
        )
    for data in kinds.get("concurrency", []):
        rows = data["results"]
        findings += concurrency_findings(rows)
        images = plot_concurrency(rows, out)
        sections += (
            markdown_heading(f"Through the server: concurrency sweep ({data['file']})", data["meta"])
            + [concurrency_table(rows), ""]
            + markdown_images(images)
        )
    plan = kinds["plan"][-1] if kinds.get("plan") else None
    for data in kinds.get("sweep", []):
        more, lines = sweep_section(data, plan, out)
        findings += more
        sections += lines
    for data in kinds.get("baseline", []):
        rows = data["results"] + matching_sweep_rows(data["meta"], kinds.get("sweep", []))
        title = f"Baseline: Hugging Face transformers vs specdecode, batch size 1 ({data['file']})"
        sections += markdown_heading(title, data["meta"]) + [baseline_table(rows), ""]
    parts += ["## Findings", ""] + [f"- {line}" for line in findings] + [""] + sections
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path


def run_report_cli(args) -> int:
    path = write_report(args.results_dir, args.out)
    print(path.read_text().split("\n## ", 2)[1] if "## Findings" in path.read_text() else "")
    print(f"wrote {path} and its plots")
    return 0
