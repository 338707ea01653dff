"""What every plot of the report shares: matplotlib without a display, PNG output, axes styling, and the
throughput/TPOT-against-concurrency plots that both the concurrency sweep and `bench sweep` draw."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..errors import SpecDecodeError


def pyplot():
    """matplotlib's pyplot on the Agg backend: the report is drawn to files, on machines with no display."""
    try:
        import matplotlib
    except ImportError:
        raise SpecDecodeError("plots need matplotlib: pip install 'specdecode[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path, name: str) -> str:
    """Write the figure to out/name and free it; the name is what the report links to."""
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    pyplot().close(fig)
    return name


def label_axes(ax, xlabel: str, ylabel: str, legend_size: int | None = None) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def log2_axis(ax, ticks) -> None:
    """Powers of two spaced evenly, each labelled with its plain value."""
    ticks = sorted(set(ticks))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[str(t) for t in ticks])


def parity_line(ax) -> None:
    """The speedup of 1: above it speculation pays."""
    ax.axhline(1.0, color="grey", linewidth=1)


def by_config(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows of a concurrency sweep as one series per configuration, by rising concurrency."""
    lines = defaultdict(list)
    for r in rows:
        lines[r["config"]].append(r)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in lines.items()}


def plot_concurrency(rows: list[dict], out: Path, prefix: str = "") -> list[str]:
    """Output throughput and mean TPOT against concurrent clients, a line per configuration."""
    plt = pyplot()
    lines = by_config(rows)
    images = []
    for metric, label, name, scale in (
        ("output_throughput", "output tokens / s", "throughput_vs_concurrency.png", 1),
        ("tpot_s", "mean TPOT (ms)", "tpot_vs_concurrency.png", 1000),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for config, series in lines.items():
            xs = [r["concurrency"] for r in series]
            ys = [(r[metric]["mean"] if isinstance(r[metric], dict) else r[metric]) * scale for r in series]
            ax.plot(xs, ys, marker="o", label=config, linestyle="--" if config == "plain" else "-")
        log2_axis(ax, (r["concurrency"] for r in rows))
        label_axes(ax, "concurrent clients", label)
        images.append(save(fig, out, prefix + name))
    return images
