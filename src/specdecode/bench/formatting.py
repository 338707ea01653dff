"""How the benchmarks write a figure in a table cell, so the console tables and the Markdown report agree."""

from __future__ import annotations


def fmt(value, spec: str, width: int = 0, missing: str = "-", suffix: str = "") -> str:
    """`value` in format `spec`, or `missing` where a figure was not measured, right-aligned in `width`."""
    text = missing if value is None else format(value, spec) + suffix
    return f"{text:>{width}}"


def ratio(value, width: int = 0, missing: str = "-", sign: str = "x") -> str:
    """A speedup or other ratio, two decimals: 1.23x on the console, 1.23× in the Markdown report."""
    return fmt(value, ".2f", width, missing, sign)


def joined(values, spec: str = ".2f") -> str:
    """Several figures in one cell, e.g. each round's ratio to plain decoding."""
    return ", ".join(format(v, spec) for v in values)


def yes_no(flag: bool | None) -> str:
    """A check that may not apply: yes, NO (capitals, to stand out) or -."""
    return "-" if flag is None else ("yes" if flag else "NO")


def mean(stats: dict | None, scale: float = 1) -> float | None:
    """The mean of a summary (TTFT, TPOT, latency in seconds), times `scale`; None if nothing was summarized."""
    return stats["mean"] * scale if stats else None


def markdown_heading(title: str, meta: dict) -> list[str]:
    """A report section's heading and the command line that produced its results."""
    return [f"## {title}", "", f"`{meta.get('command', '')}`", ""]


def markdown_images(images: list[str]) -> list[str]:
    return [f"![{name}]({name})" for name in images] + [""]
