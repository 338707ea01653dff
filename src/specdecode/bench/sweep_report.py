"""The report's part for `bench sweep` results (and the advisor's plan beside them): the k sweep with its
upper bound, throughput/TPOT against concurrency, input length, draft vs n-gram, predicted vs measured."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from .advisor import ceiling_line, plan_table, recommendation
from .formatting import fmt, markdown_heading, markdown_images, mean, ratio
from .plots import label_axes, log2_axis, parity_line, plot_concurrency, pyplot, save


def _real(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["forced_accept"]]


def proposer_name(r: dict) -> str:
    """ "draft" (the sweep's draft model), "draft NAME" (another one), or the kind ("ngram", "head:PATH")."""
    return f"draft {r['draft']}" if r["proposer"] == "draft" and r.get("draft") else r["proposer"]


def speculative_at_batch_one(r: dict) -> bool:
    """A speculative cell with a fixed k at concurrency 1 that has a plain baseline."""
    return r["concurrency"] == 1 and r["policy"] == "fixed" and r["proposer"] != "none" and bool(r.get("speedup"))


def best_by(rows: list[dict], key) -> dict:
    """The fastest of the rows for each key(row)."""
    best = {}
    for r in rows:
        k = key(r)
        if k not in best or r["speedup"] > best[k]["speedup"]:
            best[k] = r
    return best


def main_dataset(rows: list[dict]) -> str:
    """The dataset most cells use (HumanEval in the default sweep); k and load are compared on it."""
    counts = Counter(r["dataset"] for r in rows)
    return counts.most_common(1)[0][0]


def k_rows(rows: list[dict]) -> list[dict]:
    """Batch size 1, fixed k, on the main dataset: the k sweep (forced-accept rows included)."""
    dataset = main_dataset(rows)
    chosen = {}  # one cell per (proposer, k, bound): the first block that measured it
    for r in rows:
        if speculative_at_batch_one(r) and r["dataset"] == dataset:
            chosen.setdefault((proposer_name(r), r["k"], r["forced_accept"]), r)
    return list(chosen.values())


def concurrency_series(rows: list[dict]) -> dict[str, list[dict]]:
    """One line per configuration measured at two or more concurrencies (main dataset, real acceptance)."""
    series = defaultdict(dict)
    dataset = main_dataset(rows)
    for r in _real(rows):
        if r["dataset"] == dataset:
            series[r["label"]].setdefault(r["concurrency"], r)
    return {label: [by_c[c] for c in sorted(by_c)] for label, by_c in series.items() if len(by_c) > 1}


def input_length_rows(rows: list[dict]) -> dict[str, list[dict]]:
    by_proposer = defaultdict(list)
    for r in _real(rows):
        if r["dataset"].startswith("sonnet:") and speculative_at_batch_one(r):
            by_proposer[r["label"]].append(r)
    return {k: sorted(v, key=input_len) for k, v in by_proposer.items()}


def input_len(r: dict) -> int:
    return int(r["dataset"].split(":", 1)[1])


def predicted(plan: dict | None, r: dict) -> float | None:
    """The plan's prediction for a draft-model row at its k and concurrency (taken as the batch size)."""
    if not plan or r["proposer"] != "draft" or r.get("draft") or r["forced_accept"] or r["policy"] != "fixed":
        return None
    if r["dataset"] != plan.get("options", {}).get("dataset", "humaneval"):  # acceptance was measured there
        return None
    table = plan["predicted_speedup"].get(str(r["concurrency"]))
    return None if table is None else table.get(str(r["k"]))


# ---- plots ----------------------------------------------------------------------------------------------------
def plot_k_sweep(rows: list[dict], plan: dict | None, out: Path) -> list[str]:
    ks_rows = k_rows(rows)
    if not ks_rows:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    by_label = defaultdict(list)
    for r in ks_rows:
        by_label[proposer_name(r) + (" (all accepted)" if r["forced_accept"] else "")].append(r)
    for name, series in by_label.items():
        series.sort(key=lambda r: r["k"])
        ks = [r["k"] for r in series]
        style = dict(marker="o", linestyle="--" if "accepted" in name else "-", label=name)
        if "accepted" not in name:
            axes[0].plot(ks, [r["acceptance_rate"] for r in series], **style)
            axes[1].plot(ks, [r["mean_accepted_length"] for r in series], **style)
        axes[2].plot(ks, [r["speedup"] for r in series], **style)
    if plan:
        draft = sorted((r for r in ks_rows if predicted(plan, r)), key=lambda r: r["k"])
        axes[2].plot(
            [r["k"] for r in draft],
            [predicted(plan, r) for r in draft],
            marker="x",
            linestyle=":",
            label="draft: predicted (plan)",
        )
    parity_line(axes[2])
    all_ks = sorted({r["k"] for r in ks_rows})
    for ax, label in zip(axes, ("acceptance rate α", "mean accepted length τ", "speedup over plain")):
        ax.set_xticks(all_ks)
        label_axes(ax, "k (draft tokens), batch size 1", label, legend_size=8)
    return [save(fig, out, "sweep_k.png")]


def plot_input_length(rows: list[dict], out: Path) -> list[str]:
    series = input_length_rows(rows)
    if not series:
        return []
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, s in series.items():
        xs = [input_len(r) for r in s]
        ax1.plot(xs, [r["acceptance_rate"] for r in s], marker="o", label=label)
        ax2.plot(xs, [r["speedup"] for r in s], marker="o", label=label)
    parity_line(ax2)
    for ax, label in ((ax1, "acceptance rate α"), (ax2, "speedup over plain")):
        log2_axis(ax, (input_len(r) for s in series.values() for r in s))
        label_axes(ax, "input length (tokens, sonnet prompts), batch size 1", label, legend_size=8)
    return [save(fig, out, "sweep_input_length.png")]


def plot_predicted_vs_measured(rows: list[dict], plan: dict | None, out: Path) -> list[str]:
    pairs = (
        [
            (predicted(plan, r), r["speedup"], r)
            for r in rows
            if predicted(plan, r)
            and r.get("speedup")
            and r["dataset"] == plan.get("options", {}).get("dataset", "humaneval")
        ]
        if plan
        else []
    )
    if not pairs:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for c in sorted({r["concurrency"] for _, _, r in pairs}):
        pts = [(p, m) for p, m, r in pairs if r["concurrency"] == c]
        ax.scatter([p for p, _ in pts], [m for _, m in pts], label=f"concurrency {c}")
    for p, m, r in pairs:
        ax.annotate(f"k={r['k']}", (p, m), fontsize=7, xytext=(3, 3), textcoords="offset points")
    top = max(max(p, m) for p, m, _ in pairs) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=1, label="measured = predicted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    label_axes(ax, "predicted speedup (specdecode plan)", "measured speedup (sweep)", legend_size=8)
    return [save(fig, out, "sweep_predicted_vs_measured.png")]


def plot_sweep_concurrency(rows: list[dict], out: Path) -> list[str]:
    series = concurrency_series(rows)
    flat = [{**r, "config": label} for label, s in series.items() for r in s]
    return plot_concurrency(flat, out, prefix="sweep_") if flat else []


# ---- tables and findings --------------------------------------------------------------------------------------
def sweep_table(rows: list[dict], plan: dict | None) -> str:
    out = [
        "| block | dataset | config | conc | tok/s | speedup | predicted | TPOT ms | TTFT s | α | τ |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['group']} | {r['dataset']} | {r['label']} | {r['concurrency']} | "
            f"{r['output_throughput']:.2f} | {fmt(r.get('speedup'), '.2f')} | "
            f"{fmt(predicted(plan, r), '.2f')} | "
            f"{fmt(mean(r.get('tpot_s'), 1000), '.0f')} | {fmt(mean(r.get('ttft_s')), '.2f')} | "
            f"{fmt(r.get('acceptance_rate'), '.3f')} | {fmt(r.get('mean_accepted_length'), '.2f')} |"
        )
    return "\n".join(out)


def proposer_table(rows: list[dict]) -> str:
    """Every proposer, per dataset, at batch size 1: its best fixed k."""
    best = best_by(filter(speculative_at_batch_one, _real(rows)), lambda r: (r["dataset"], proposer_name(r)))
    out = ["| dataset | proposer | best k | α | τ | speedup |", "|---|---|---:|---:|---:|---:|"]
    for (dataset, proposer), r in sorted(best.items(), key=lambda kv: (_dataset_order(kv[0][0]), kv[0][1])):
        out.append(
            f"| {dataset} | {proposer} | {r['k']} | {fmt(r['acceptance_rate'], '.3f')} | "
            f"{fmt(r['mean_accepted_length'], '.2f')} | {ratio(r['speedup'], sign='×')} |"
        )
    return "\n".join(out) if best else ""


def _dataset_order(dataset: str) -> tuple:
    return (dataset.startswith("sonnet:"), input_len({"dataset": dataset}) if dataset.startswith("sonnet:") else 0)


def sweep_findings(rows: list[dict], plan: dict | None) -> list[str]:
    found = []
    real_k = _real(k_rows(rows))
    if real_k:
        best = max(real_k, key=lambda r: r["speedup"])
        text = f"Best k at concurrency 1 ({best['dataset']}): {best['label']}, {best['speedup']:.2f}× plain decoding"
        if plan:
            text += f"; the plan recommended k = {plan['recommended_k']}"
        found.append(text + ".")
    bound = [r for r in k_rows(rows) if r["forced_accept"]]
    for r in sorted(bound, key=lambda r: r["k"]):
        real = next((x for x in real_k if proposer_name(x) == proposer_name(r) and x["k"] == r["k"]), None)
        found.append(
            f"Upper bound, every draft token accepted, {proposer_name(r)} k={r['k']}: {r['speedup']:.2f}×"
            + (f" (real acceptance reaches {real['speedup'] / r['speedup']:.0%} of it)." if real else ".")
        )
    for label, s in concurrency_series(rows).items():
        if label == "plain":
            continue
        if "adaptive" in label:
            worst = min(s, key=lambda r: r.get("speedup", 1))
            found.append(
                f"{label} stays at or above plain decoding at every concurrency measured "
                f"(lowest {worst['speedup']:.2f}× at concurrency {worst['concurrency']})."
                if worst["speedup"] >= 1
                else f"{label} falls below plain decoding at concurrency "
                f"{', '.join(str(r['concurrency']) for r in s if r.get('speedup', 1) < 1)} "
                f"(lowest {worst['speedup']:.2f}× at concurrency {worst['concurrency']})."
            )
        else:
            losing = [r for r in s if r.get("speedup", 1) < 1]
            found.append(
                f"{label} stops paying at concurrency {losing[0]['concurrency']} ({losing[0]['speedup']:.2f}× plain)."
                if losing
                else f"{label} pays at every concurrency measured (lowest {min(r['speedup'] for r in s):.2f}×)."
            )
    ratios = [(r["speedup"] / predicted(plan, r), r) for r in rows if predicted(plan, r) and r.get("speedup")]
    if ratios:
        at1 = [x for x, r in ratios if r["concurrency"] == 1]
        above = [x for x, r in ratios if r["concurrency"] > 1]
        text = "Measured speedup relative to the plan's prediction: "
        parts = [
            f"{min(v):.0%}–{max(v):.0%} at {name}"
            for v, name in ((at1, "concurrency 1"), (above, "higher concurrency"))
            if v
        ]
        found.append(text + "; ".join(parts) + ".")
    for label, s in input_length_rows(rows).items():
        if len(s) > 1:
            a, b = s[0], s[-1]
            found.append(
                f"Input length {input_len(a)} → {input_len(b)} tokens, {label}: "
                f"α {a['acceptance_rate']:.3f} → {b['acceptance_rate']:.3f}, "
                f"speedup {a['speedup']:.2f}× → {b['speedup']:.2f}×."
            )
    found += proposer_findings(rows)
    return found


def proposer_findings(rows: list[dict]) -> list[str]:
    """Per dataset kind (sonnet lengths together), the proposers ranked by their best fixed k's speedup."""
    found = []
    by_dataset = defaultdict(dict)
    for (kind, proposer), r in best_by(
        filter(speculative_at_batch_one, _real(rows)),
        lambda r: ("sonnets" if r["dataset"].startswith("sonnet:") else r["dataset"], proposer_name(r)),
    ).items():
        by_dataset[kind][proposer] = r
    for kind, best in by_dataset.items():
        if len(best) > 1:
            ranked = sorted(best.items(), key=lambda item: -item[1]["speedup"])
            found.append(
                f"On {kind}, by each proposer's best fixed k: "
                + ", ".join(
                    f"{name} {r['speedup']:.2f}× (α {r['acceptance_rate']:.3f}, k={r['k']})" for name, r in ranked
                )
                + "."
            )
    return found


def sweep_section(data: dict, plan: dict | None, out: Path) -> tuple[list[str], list[str]]:
    """(findings, Markdown lines) for one sweep.json."""
    rows = data["results"]
    images = (
        plot_k_sweep(rows, plan, out)
        + plot_sweep_concurrency(rows, out)
        + plot_input_length(rows, out)
        + plot_predicted_vs_measured(rows, plan, out)
    )
    minutes = data["meta"].get("seconds", 0) / 60
    lines = markdown_heading(
        f"Sweep ({data['file']}, {len(rows)} cells, {minutes:.1f} min)", data["meta"]
    ) + markdown_images(images)
    table = proposer_table(rows)
    if table:
        lines += ["### Proposers at batch size 1 (each one's best fixed k)", "", table, ""]
    if plan:
        advice = _int_keys(plan)
        lines += ["### The advisor's plan (`specdecode plan`)", "", "```", plan_table(advice)]
        lines += [ceiling_line(advice)] if "ceiling" in advice else []  # plans written before it had none
        lines += [recommendation(advice), "```", ""]
    lines += ["### All cells", "", sweep_table(rows, plan), ""]
    return sweep_findings(rows, plan), lines


def _int_keys(plan: dict) -> dict:
    """JSON turned the plan's int keys into strings; the printing helpers want them back."""

    def conv(d):
        return {int(k): conv(v) if isinstance(v, dict) else v for k, v in d.items()}

    keys = ("alpha", "expected_tokens", "target_seconds", "draft_seconds", "predicted_speedup", "best_k", "ceiling")
    return {**plan, **{key: conv(plan[key]) for key in keys if key in plan}}
