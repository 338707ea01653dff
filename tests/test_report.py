"""The report renders from stored results: plots are real PNGs, tables and findings carry the numbers."""

import json
import shutil
from pathlib import Path

import pytest

from specdecode import SpecDecodeError
from specdecode.bench.concurrency import add_ratios_to_plain
from specdecode.bench.report import concurrency_findings, write_report

LATENCY = Path(__file__).parent.parent / "docs" / "bench" / "latency-humaneval-cpu.json"


def _row(config, c, tok_s, tpot, alpha=None):
    return {
        "config": config,
        "concurrency": c,
        "output_throughput": tok_s,
        "tpot_s": {"mean": tpot},
        "ttft_s": {"mean": 1.0},
        "acceptance_rate": alpha,
        "speculating_fraction": 0.0 if alpha is None else 1.0,
    }


def _sweep():
    rows = [
        _row("plain", 1, 5.0, 0.2),
        _row("plain", 4, 16.0, 0.25),
        _row("plain", 16, 40.0, 0.4),
        _row("fixed", 1, 8.0, 0.12, 0.8),
        _row("fixed", 4, 14.0, 0.28, 0.8),
        _row("fixed", 16, 20.0, 0.8, 0.8),
        _row("adaptive", 1, 7.5, 0.13, 0.8),
        _row("adaptive", 4, 16.2, 0.25),
        _row("adaptive", 16, 40.5, 0.4),
    ]
    add_ratios_to_plain(rows)
    return rows


def test_findings_from_known_numbers():
    found = concurrency_findings(_sweep())
    assert found[0] == "Fixed-k speculation stops paying at concurrency 4 (0.88× plain)."
    assert "stays at or above" in found[1] and "1.01× at concurrency 4" in found[1]
    assert "1.54× lower" in found[2]  # 0.2 / 0.13


@pytest.mark.parametrize("drafted, idle", [(0.0, True), (0.4, False)])
def test_a_loss_without_drafting_is_named_as_such(drafted, idle):
    """Below plain where adaptive drafted nothing, the two servers did the same work: the finding says so;
    below plain while drafting is a loss of the policy's and is not excused."""
    rows = _sweep()
    adaptive_4 = next(r for r in rows if r["config"] == "adaptive" and r["concurrency"] == 4)
    adaptive_4.update(output_throughput=15.5, speculating_fraction=drafted)
    add_ratios_to_plain(rows)
    found = concurrency_findings(rows)[1]
    assert "falls below" in found and "0.97× at concurrency 4" in found
    assert ("drafted nothing" in found) == idle
    assert ("drafted in 40% of its steps" in found) == (not idle)  # how much of the loss drafting could explain


def test_report_renders_plots_and_tables(tmp_path):
    shutil.copy(LATENCY, tmp_path / "latency.json")
    (tmp_path / "concurrency.json").write_text(
        json.dumps({"meta": {"command": "specdecode bench concurrency"}, "results": _sweep()})
    )
    report = write_report(tmp_path)
    text = report.read_text()
    for png in ("throughput_vs_concurrency.png", "tpot_vs_concurrency.png", "acceptance_vs_k.png", "speedup_vs_k.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text
    assert "| fixed | 16 | 20.00 | 0.50× |" in text
    latency = json.loads(LATENCY.read_text())["results"]
    best = max((r for r in latency if r["k"] > 0), key=lambda r: r["speedup"])
    assert f"Best configuration at concurrency 1: {best['config']}" in text
    assert "Every greedy speculative output was identical to plain decoding." in text
    peer = [r for r in latency if r["config"] == "llama.cpp: plain (mean)"]
    if peer:  # llama.cpp ran beside us: its rows are a peer's, not counted among ours
        ours = next(r for r in latency if r["k"] == 0 and r["backend"] != "llama.cpp")
        assert f"Plain decoding: {ours['tokens_per_s'] / peer[0]['tokens_per_s']:.2f}× llama.cpp's" in text
        assert "llama.cpp's own best speculation" in text


def test_report_on_an_empty_folder_says_what_is_missing(tmp_path):
    with pytest.raises(SpecDecodeError, match="no benchmark results"):
        write_report(tmp_path)


def test_rounds_are_pooled_and_paired_with_plain():
    from specdecode.bench.concurrency import pooled_row
    from specdecode.bench.load import RequestResult

    def req(tokens):
        return RequestResult(ok=True, output_tokens=tokens, ttft_s=0.5, latency_s=0.5 + (tokens - 1) * 0.1)

    plain = pooled_row("plain", 2, [([req(10), req(10)], 4.0), ([req(10), req(10)], 5.0)])
    fast = pooled_row("adaptive", 2, [([req(10), req(10)], 2.0), ([req(10), req(10)], 10.0)])
    assert plain["output_throughput"] == pytest.approx(40 / 9.0)  # all tokens / all seconds, not a mean of rates
    assert plain["round_throughputs"] == pytest.approx([5.0, 4.0])
    rows = [plain, fast]
    add_ratios_to_plain(rows)
    assert fast["throughput_vs_plain"] == pytest.approx(9.0 / 12.0)
    assert fast["round_throughputs_vs_plain"] == pytest.approx([2.0, 0.5])  # round i against plain's round i


def test_multi_turn_rows_show_the_later_turns_tpot_against_plain():
    """Sessions' later turns have earlier replies to copy: their TPOT ratio is printed beside the pooled one."""
    from specdecode.bench.concurrency import summary_table

    rows = [_row("plain", 8, 80.0, 0.09), _row("adaptive-suffix", 8, 96.0, 0.075, 0.88)]
    rows[0]["later_turns_tpot_s"], rows[1]["later_turns_tpot_s"] = {"mean": 0.086}, {"mean": 0.0645}
    add_ratios_to_plain(rows)
    assert rows[1]["later_turns_tpot_reduction_vs_plain"] == pytest.approx(0.086 / 0.0645)
    table = summary_table(rows).splitlines()
    assert "later turns: TPOT ms" in table[0]
    assert table[2].split()[-2:] == ["64.5", "1.33x"]
    assert "later turns" not in summary_table(_sweep())  # single-turn rows keep the short table
