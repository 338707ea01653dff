"""`specdecode bench sweep --config FILE`: the standard speculative-decoding study as a grid.

A config (TOML, or YAML when PyYAML is installed) names the models and a list of grid blocks; in each
block, keys given as lists are crossed. Every cell runs the same prompts, greedy, EOS ignored, and is
measured either in-process (one loaded target and draft shared by all cells, a closed loop driving the
engine) or through `specdecode serve` processes started and stopped by the sweep. Each cell's result is
written to RUNS/NN-label.json, all of them to sweep.json with speedups against plain decoding of the
same dataset and concurrency; then, unless --no-report, `bench report` draws the plots.

    [sweep]
    mode = "in-process"            # or "server"
    max_tokens = 64
    [[grid]]
    name = "k"                     # the block's name; the report groups by it
    proposer = ["none", "draft", "ngram"]
    k = [2, 4, 6]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import tomllib
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from ..config import POLICIES
from ..errors import SpecDecodeError
from ..models.sources import DEFAULT_DRAFT, DEFAULT_TARGET
from ..proposers import proposer_names
from ..proposers.registry import DRAFT_MODEL
from .advisor import AdvisorOptions, calibrate, print_advice
from .datasets import load_prompts, repeat_to, token_counter
from .formatting import fmt, mean, ratio
from .load import LoadResult, RequestResult, run_load, send_requests
from .report import write_report
from .results import command_line, machine_info, speedup_against
from .server_process import ServerProcess, serve_argv

MODEL_PROPOSERS = ("none", "draft")  # plain decoding, and the draft model named in [sweep] draft or the cell


@dataclass(frozen=True)
class Cell:
    """One measurement: what proposes, how much, under what load, on which prompts."""

    group: str = "grid"
    dataset: str = "humaneval"  # humaneval, sonnet:LEN, jsonl:PATH, hf:NAME
    proposer: str = "none"  # none (plain decoding), draft, or a registered kind: ngram, suffix, head:PATH
    draft: str = ""  # for proposer draft: the draft model ("" = the sweep's `draft`); a list compares drafts
    k: int = 4
    policy: str = "fixed"  # fixed, adaptive, disable_by_batch_size
    disable_by_batch_size: int = 4  # for that policy: no drafts while more sequences than this are running
    concurrency: int = 1
    forced_accept: bool = False  # every draft token accepted: the upper bound (lossy)
    prompt_lookup: str | None = None  # adaptive policy with a draft model: may draft by this lookup too
    # the draft stops after a token it gives less probability; 0 (the standard study): exactly k per step
    draft_confidence: float = 0.0
    num_prompts: int = 4
    max_tokens: int = 64

    @property
    def label(self) -> str:
        if self.proposer == "none":
            return "plain"
        policy = {
            "fixed": "",
            "adaptive": " adaptive",
            "disable_by_batch_size": f" off above {self.disable_by_batch_size}",
        }[self.policy]
        name = f"draft {self.draft}" if self.proposer == "draft" and self.draft else self.proposer
        text = f"{name} k={self.k}{policy}" + (f" +{self.prompt_lookup}" if self.prompt_lookup else "")
        text += f" conf {self.draft_confidence:g}" if self.draft_confidence else ""
        return text + (" forced-accept" if self.forced_accept else "")

    @property
    def num_requests(self) -> int:
        """At least one request per client, so every cell fills its concurrency."""
        return max(self.num_prompts, self.concurrency)

    def normalized(self) -> "Cell":
        if self.proposer == "none":
            return replace(
                self, k=0, policy="fixed", forced_accept=False, disable_by_batch_size=0, draft="", prompt_lookup=None
            )
        if self.proposer not in MODEL_PROPOSERS:  # a registered kind (ngram, ...) runs no draft model
            self = replace(self, draft="", prompt_lookup=None)
        elif self.policy != "adaptive":
            self = replace(self, prompt_lookup=None)  # lookup beside a draft model is the adaptive policy's
        return self if self.policy == "disable_by_batch_size" else replace(self, disable_by_batch_size=0)


CELL_KEYS = {f.name for f in fields(Cell)} - {"group"}


@dataclass
class SweepConfig:
    model: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    mode: str = "in-process"  # or "server"
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int = 2048
    seed: int = 0
    sonnet_file: str | None = None
    out: str = "results/sweep"
    plan: dict | None = None  # options for the advisor's calibration run (see bench/advisor.py), or none
    cells: list[Cell] = field(default_factory=list)


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise SpecDecodeError(f"sweep config {path} not found; see configs/sweep-cpu.toml for an example")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SpecDecodeError(
                "YAML configs need PyYAML (pip install pyyaml), or write the config as TOML"
            ) from None
        data = yaml.safe_load(text)
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SpecDecodeError(f"{path} is not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecDecodeError(f"{path}: expected a table with [sweep] and [[grid]] sections")
    return data


def parse_config(data: dict, source: str = "config") -> SweepConfig:
    unknown = set(data) - {"sweep", "grid", "plan"}
    if unknown:
        raise SpecDecodeError(f"{source}: unknown section(s) {sorted(unknown)}; use [sweep], [plan] and [[grid]]")
    sweep = dict(data.get("sweep", {}))
    defaults = {k: sweep.pop(k) for k in list(sweep) if k in CELL_KEYS - {"draft"}}  # [sweep] draft: the default
    known = {f.name for f in fields(SweepConfig)} - {"cells", "plan"}
    if set(sweep) - known:
        raise SpecDecodeError(
            f"{source}: unknown [sweep] key(s) {sorted(set(sweep) - known)}; known: {sorted(known | CELL_KEYS)}"
        )
    config = SweepConfig(**sweep, plan=data.get("plan"))
    if config.mode not in ("in-process", "server"):
        raise SpecDecodeError(f"{source}: mode must be 'in-process' or 'server', got {config.mode!r}")
    blocks = data.get("grid") or []
    if not blocks:
        raise SpecDecodeError(f'{source}: no [[grid]] blocks; add at least one, e.g. proposer = ["none", "draft"]')
    for i, block in enumerate(blocks):
        cells = expand_block(block, defaults, f"{source} grid block {i + 1}")
        # a server restarts per configuration, so there the block keeps its order
        config.cells += baselines_first(cells) if config.mode == "in-process" else cells
    return config


def baselines_first(cells: list[Cell]) -> list[Cell]:
    """The cells that share a plain baseline (dataset, concurrency, output length) one after another, the
    baseline first: the host's drift over the minutes a block takes then stays out of their speedups."""
    order: dict[tuple, int] = {}
    for c in cells:
        order.setdefault((c.dataset, c.concurrency, c.max_tokens), len(order))
    return sorted(cells, key=lambda c: (order[(c.dataset, c.concurrency, c.max_tokens)], c.proposer != "none"))


def expand_block(block: dict, defaults: dict, where: str) -> list[Cell]:
    """The cross product of the block's list-valued keys; plain-decoding cells ignore k and policy."""
    block = dict(block)
    name = str(block.pop("name", where.rsplit(" ", 1)[-1]))
    unknown = set(block) - CELL_KEYS
    if unknown:
        raise SpecDecodeError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(CELL_KEYS | {'name'})}")
    merged = {**defaults, **block}
    axes = {key: value if isinstance(value, list) else [value] for key, value in merged.items()}
    cells: list[Cell] = []
    for combo in itertools.product(*axes.values()):
        cell = Cell(group=name, **dict(zip(axes, combo))).normalized()
        check_cell(cell, where)
        if cell not in cells:
            cells.append(cell)
    return cells


def proposer_choices() -> list[str]:
    """Plain, the draft model, and every other registered proposer kind."""
    return [*MODEL_PROPOSERS, *(name for name in proposer_names() if name != DRAFT_MODEL)]


def check_cell(cell: Cell, where: str) -> None:
    known = proposer_choices()
    kinds_with_argument = known[len(MODEL_PROPOSERS) :]  # head:PATH, as `--draft` takes it
    if cell.proposer not in known and cell.proposer.partition(":")[0] not in kinds_with_argument:
        raise SpecDecodeError(
            f"{where}: proposer {cell.proposer!r} is not one of {', '.join(known)} or "
            "KIND:ARGUMENT (e.g. head:PATH; the draft model itself is [sweep] draft)"
        )
    if cell.policy not in POLICIES:
        raise SpecDecodeError(f"{where}: policy {cell.policy!r} is not one of {', '.join(POLICIES)}")
    if cell.proposer != "none" and cell.k < 1:
        raise SpecDecodeError(f"{where}: k must be >= 1 for proposer {cell.proposer!r} (use proposer none for plain)")
    for key in ("concurrency", "num_prompts", "max_tokens"):
        if getattr(cell, key) < 1:
            raise SpecDecodeError(f"{where}: {key} must be >= 1, got {getattr(cell, key)}")


# ---- running cells -------------------------------------------------------------------------------------------
class PromptCache:
    """Each dataset's prompts, built once (sonnet prompts are sized by the target's tokenizer)."""

    def __init__(self, config: SweepConfig, count_tokens):
        self.config, self.count_tokens, self._prompts = config, count_tokens, {}

    def get(self, cell: Cell) -> list[str]:
        key = (cell.dataset, cell.num_requests)
        if key not in self._prompts:
            self._prompts[key] = load_prompts(
                cell.dataset,
                cell.num_requests,
                count_tokens=self.count_tokens,
                seed=self.config.seed,
                sonnet_file=self.config.sonnet_file,
            )
        return repeat_to(self._prompts[key], cell.num_requests)


def drive_closed_loop(
    engine, prompt_ids: list[list[int]], params, concurrency: int
) -> tuple[list[RequestResult], float]:
    """Keep `concurrency` requests in the engine until all prompts are done; per-request timings as the
    load generator would see them (arrival = when the request entered the engine)."""
    pending, in_flight, results = deque(prompt_ids), [], []
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            in_flight.append(engine.add_request(pending.popleft(), params))
        engine.step()
        for seq in [s for s in in_flight if s.finished]:
            in_flight.remove(seq)
            m = seq.metrics
            results.append(
                RequestResult(
                    ok=True,
                    prompt_tokens=len(seq.prompt_ids),
                    output_tokens=seq.num_output_tokens,
                    ttft_s=m.ttft,
                    latency_s=m.finish_time - m.arrival_time,
                    speculation=m.as_dict(),
                )
            )
    return results, time.perf_counter() - start


class InProcessRunner:
    """One loaded target (and draft) for all cells; a fresh engine per cell, like a fresh server."""

    def __init__(self, config: SweepConfig, cells: list[Cell], target=None, draft=None, drafts=None):
        from ..models.loader import load_model

        self.config = config
        self.target = target or load_model(config.model, config.device, config.dtype)
        self.drafts = dict(drafts or {})  # draft models by name, loaded when a cell first needs one
        if draft is not None:
            self.drafts[config.draft] = draft
        self.prompts = PromptCache(config, lambda text: len(self.target.tokenizer.encode(text)))

    def draft_model(self, name: str = ""):
        from ..models.loader import load_model

        name = name or self.config.draft
        if name not in self.drafts:
            self.drafts[name] = load_model(name, str(self.target.model.device), self.config.dtype)
        return self.drafts[name]

    def build(self, cell: Cell, max_num_seqs: int):
        from ..engine.llm import LLM

        return LLM(
            target=self.target,
            draft=self.draft_model(cell.draft) if cell.proposer == "draft" else None,
            speculative_model=None if cell.proposer in MODEL_PROPOSERS else cell.proposer,
            num_speculative_tokens=cell.k,
            max_model_len=self.config.max_model_len,
            max_num_seqs=max_num_seqs,
            forced_accept=cell.forced_accept,
            speculation_policy=cell.policy,
            prompt_lookup=cell.prompt_lookup,
            draft_confidence=cell.draft_confidence,
            speculative_disable_by_batch_size=cell.disable_by_batch_size or None,
            prefix_caching=False,
            suffix_cache_scope="none",
        )  # the study's prompts repeat: every cell computes them whole, and drafts from no earlier output of them

    def run(self, cell: Cell) -> dict:
        from ..sampling import SamplingParams

        llm = self.build(cell, cell.concurrency)
        prompts = [self.target.tokenizer.encode(p) for p in self.prompts.get(cell)]
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8))  # warm-up (and the policy's first costs)
        llm.timer.reset()
        params = SamplingParams(temperature=0, max_tokens=cell.max_tokens, ignore_eos=True)
        requests, seconds = drive_closed_loop(llm.engine, prompts, params, cell.concurrency)
        timer = llm.timer
        return {
            **result_row(cell, requests, seconds),
            "target_step_ms": timer.target_step_s * 1000 if timer.target_step_s else None,
            "draft_step_ms": timer.draft_step_s * 1000 if timer.draft_step_s else None,
        }

    def close(self) -> None:
        pass


class ServerRunner:
    """Cells that share a server configuration share one `specdecode serve` process."""

    def __init__(self, config: SweepConfig, cells: list[Cell]):
        self.config, self.cells = config, cells
        self.max_seqs = max(c.concurrency for c in cells)
        self.prompts = PromptCache(config, lambda text: self._count(text))
        self._count_tokens = None
        self.server, self.server_key = None, None

    def _count(self, text: str) -> int:
        if self._count_tokens is None:  # loaded only when a dataset is sized in tokens
            self._count_tokens = token_counter(self.config.model)
        return self._count_tokens(text)

    def serve_args(self, cell: Cell) -> list[str]:
        c = self.config
        draft = cell.draft or c.draft if cell.proposer in MODEL_PROPOSERS else cell.proposer
        return serve_argv(
            c.model,
            self.max_seqs,
            c.max_model_len,
            c.dtype,
            device=c.device,
            draft=draft,
            k=0 if cell.proposer == "none" else cell.k,
            policy=cell.policy,
            disable_by_batch_size=cell.disable_by_batch_size,
            forced_accept=cell.forced_accept,
            prompt_lookup=cell.prompt_lookup,
            suffix_cache_scope="none",  # the study's prompts repeat (as in-process: the same outputs to copy)
        )

    def run(self, cell: Cell) -> dict:
        key = tuple(self.serve_args(cell))
        if key != self.server_key:
            self.close()
            self.server, self.server_key = ServerProcess(list(key)).__enter__(), key
            asyncio.run(run_load(self.server.base_url, self.prompts.get(cell)[:1], 8, progress=False))  # warm-up
        requests, seconds = asyncio.run(
            send_requests(self.server.base_url, self.prompts.get(cell), cell.max_tokens, concurrency=cell.concurrency)
        )
        return result_row(cell, requests, seconds)

    def close(self) -> None:
        if self.server is not None:
            self.server.__exit__(None, None, None)
            self.server, self.server_key = None, None


def result_row(cell: Cell, requests: list[RequestResult], seconds: float) -> dict:
    load = LoadResult.from_requests(requests, seconds, cell.concurrency, None)
    return {
        **asdict(cell),
        "label": cell.label,
        **load.as_dict(),
        "acceptance_per_position": mean_positions(requests) or None,
    }


def mean_positions(requests: list[RequestResult]) -> list[float]:
    """Per-position acceptance over the cell's requests, weighted by how often each position was drafted
    (request stats carry rates, so weight them by the request's speculative steps)."""
    sums: dict[int, list[float]] = {}
    for r in requests:
        spec = r.speculation or {}
        weight = spec.get("num_spec_steps", 0)
        for i, rate in enumerate(spec.get("acceptance_per_position") or []):
            total = sums.setdefault(i, [0.0, 0.0])
            total[0] += rate * weight
            total[1] += weight
    return [a / w if w else 0.0 for a, w in (sums[i] for i in sorted(sums))]


def add_speedups(rows: list[dict]) -> None:
    """Each row against plain decoding on the same dataset, concurrency and output length: from its own
    block if it has one, else from a block with as many requests, else from any."""
    plain = [r for r in rows if r["proposer"] == "none"]
    for r in rows:
        same = [
            p
            for p in plain
            if p["dataset"] == r["dataset"]
            and p["concurrency"] == r["concurrency"]
            and p["max_tokens"] == r["max_tokens"]
        ]
        same.sort(key=lambda p: (p["group"] != r["group"], p["num_requests"] != r["num_requests"]))
        speedup, tpot = speedup_against(r, same[0]) if same else (None, None)
        if speedup is not None:
            r["speedup"] = speedup
            if tpot is not None:
                r["tpot_reduction"] = tpot


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def run_file_name(number: int, cell: Cell) -> str:
    """Numbered in the order the cells ran, and named so that a listing of runs/ reads as the grid."""
    return f"{number:02d}-{slug(cell.group)}-{slug(cell.dataset)}-{slug(cell.label)}-c{cell.concurrency}.json"


def measure_grid(config: SweepConfig, config_path: str = "", runner=None) -> dict:
    """Every cell of the grid in turn, each written to runs/ as it finishes; all of them, with their
    speedups, to sweep.json."""
    out = Path(config.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    meta = {
        "kind": "sweep",
        "command": command_line(),
        "config": config_path,
        "model": config.model,
        "draft": config.draft,
        "mode": config.mode,
        "dtype": config.dtype,
        "machine": machine_info(),
        "cuda": torch.cuda.is_available(),
    }
    runner = runner or (InProcessRunner if config.mode == "in-process" else ServerRunner)(config, config.cells)
    started = time.perf_counter()
    try:
        if config.plan is not None:
            run_plan_step(config, runner, out)
        rows = []
        print(HEADER, flush=True)
        for i, cell in enumerate(config.cells, 1):
            row = runner.run(cell)
            rows.append(row)
            (out / "runs" / run_file_name(i, cell)).write_text(json.dumps({"meta": meta, "result": row}, indent=2))
            print(row_text(row), flush=True)
    finally:
        runner.close()
    add_speedups(rows)
    meta["seconds"] = time.perf_counter() - started
    report = {"meta": meta, "results": rows}
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    return report


def run_plan_step(config: SweepConfig, runner, out: Path) -> None:
    """The advisor's calibration, on the sweep's own models, so the report can set its predictions beside
    the measured cells."""
    if not isinstance(runner, InProcessRunner):  # server mode: the models are loaded here for the calibration only
        runner = InProcessRunner(config, [Cell(proposer="draft")])
    options = AdvisorOptions(**config.plan)
    plan = calibrate(runner.target, runner.draft_model(), options, config.seed)
    print_advice(plan)
    (out / "plan.json").write_text(json.dumps(plan, indent=2))


HEADER = (
    f"{'group':<14}{'dataset':<12}{'config':<26}{'conc':>5}{'reqs':>5}{'tok/s':>9}{'TPOT ms':>9}"
    f"{'TTFT s':>8}{'α':>7}{'τ':>6}"
)


def row_text(r: dict) -> str:
    """One cell's measurement, as it finishes."""
    return (
        f"{r['group']:<14}{r['dataset']:<12}{r['label']:<26}{r['concurrency']:>5}{r['num_requests']:>5}"
        f"{r['output_throughput']:>9.2f}{fmt(mean(r['tpot_s'], 1000), '.1f', 9)}{fmt(mean(r['ttft_s']), '.2f', 8)}"
        f"{fmt(r['acceptance_rate'], '.3f', 7)}{fmt(r['mean_accepted_length'], '.2f', 6)}"
    )


def summary_table(rows: list[dict]) -> str:
    lines = [f"{'group':<14}{'dataset':<12}{'config':<26}{'conc':>5}{'tok/s':>9}{'speedup':>9}{'TPOT ÷':>8}{'α':>7}"]
    for r in rows:
        lines.append(
            f"{r['group']:<14}{r['dataset']:<12}{r['label']:<26}{r['concurrency']:>5}"
            f"{r['output_throughput']:>9.2f}{ratio(r.get('speedup'), 9)}{ratio(r.get('tpot_reduction'), 8)}"
            f"{fmt(r.get('acceptance_rate'), '.3f', 7)}"
        )
    return "\n".join(lines)


def run_sweep_cli(args) -> int:
    config = parse_config(read_config(args.config), args.config)
    if args.out:
        config.out = args.out
    if args.mode:
        config.mode = args.mode
    print(f"{len(config.cells)} cells ({config.mode}), results in {config.out}", flush=True)
    report = measure_grid(config, args.config)
    print("\n" + summary_table(report["results"]))
    print(
        f"\n{len(report['results'])} cells in {report['meta']['seconds'] / 60:.1f} min; wrote "
        f"{config.out}/sweep.json and {config.out}/runs/"
    )
    if not args.no_report:
        path = write_report(config.out)
        print(f"wrote {path} and its plots")
    return 0
