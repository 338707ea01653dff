"""Command line: `specdecode generate ...`, `specdecode bench latency ...`."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import fields

from .config import DRAFT_CONFIDENCE, KV_CACHE_DTYPES, QUANTIZATIONS, AdaptiveOptions
from .config import EngineConfig as C  # every engine default, written once there
from .distill.recipe import GPU_RECIPE, Recipe
from .errors import SpecDecodeError
from .models.sources import DEFAULT_DRAFT, DEFAULT_TARGET
from .server.reasoning import PARSERS as REASONING_PARSERS

R = Recipe()  # every distill default, written once there


def _help(name: str) -> str:
    """An engine option's help, as config.py gives it."""
    return next(f.metadata["help"] for f in fields(C) if f.name == name).replace("%", "%%")


def _add_model_args(p: argparse.ArgumentParser, several_backends: bool = False) -> None:
    """The model flags of `plan` and `bench latency`: their draft-model rows draft with the bundled 0.5B, and
    `bench latency` measures several backends and confidence thresholds in one run."""
    p.add_argument("--model", default=C.model, help=_help("model"))
    p.add_argument(
        "--draft",
        default=None,
        help=f"draft model or proposer kind, e.g. ngram, suffix, head:PATH (default {DEFAULT_DRAFT} "
        f"with the default target)",
    )
    p.add_argument("--device", default=C.device, help=_help("device"))
    p.add_argument("--dtype", default=C.dtype, help=_help("dtype"))
    p.add_argument("--draft-vocab-size", type=int, default=C.draft_vocab_size, help=_help("draft_vocab_size"))
    several = {"nargs": "+"} if several_backends else {}
    p.add_argument(
        "--draft-confidence",
        type=float,
        **several,
        default=[0.0, DRAFT_CONFIDENCE] if several_backends else C.draft_confidence,
        help=("thresholds to measure, each with its own rows; " if several else "") + _help("draft_confidence"),
    )
    p.add_argument(
        "--quantization",
        default=[C.quantization] if several else C.quantization,
        choices=QUANTIZATIONS,
        **several,
        help=("backends to measure, each with its own plain row; " if several else "") + _help("quantization"),
    )
    _add_draft_and_cache_formats(p)
    p.add_argument("--max-model-len", type=int, default=C.max_model_len, help=_help("max_model_len"))


def _add_draft_and_cache_formats(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-quantization", default=C.draft_quantization, choices=QUANTIZATIONS, help=_help("draft_quantization")
    )
    p.add_argument("--kv-cache-dtype", default=C.kv_cache_dtype, choices=KV_CACHE_DTYPES, help=_help("kv_cache_dtype"))


def _engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """EngineConfig's fields as flags, their help, choices and defaults read from config.py (their one place)."""
    for f in fields(C):
        if f.name not in skip:
            p.add_argument(*_flag_names(f), **_flag_spec(f))


def _lora_flag(p: argparse.ArgumentParser, help: str, dtype: bool = False) -> None:
    """EngineConfig's --lora (PATH[:SCALE], repeatable) on a command that loads the target itself, with its help;
    and its --lora-dtype where `dtype`."""
    lora = next(f for f in fields(C) if f.name == "lora")
    p.add_argument(*_flag_names(lora), **_flag_spec(lora) | {"help": help})
    if dtype:
        lora_dtype = next(f for f in fields(C) if f.name == "lora_dtype")
        p.add_argument(*_flag_names(lora_dtype), **_flag_spec(lora_dtype))


def _flag_names(f) -> tuple[str, ...]:
    dashed = f.name.replace("_", "-")
    if f.type == "bool" and f.default:
        return (f"--no-{dashed}",)
    return f.metadata.get("flags", (f"--{dashed}",))


def _flag_spec(f) -> dict:
    meta = f.metadata
    spec = {"dest": f.name, "help": meta["help"].replace("%", "%%")}
    if f.name == "adaptive":
        knobs = ", ".join(f"{k.name}={k.default}" for k in fields(AdaptiveOptions))
        return spec | {
            "type": _adaptive_knob,
            "action": "append",
            "default": [],
            "metavar": "KNOB=VALUE",
            "help": spec["help"] + f"; repeatable, of: {knobs}",
        }
    if f.type == "bool":
        return spec | {"action": "store_false" if f.default else "store_true"}
    if "repeatable" in meta:
        return spec | {"action": "append", "default": [], "metavar": meta["repeatable"]}
    default = meta["none"] if f.default is None and "none" in meta else f.default
    kind = f.type.split(" |")[0]
    spec |= {"default": default, "type": {"int": int, "float": float}.get(kind, str)}
    if kind in ("int", "float") and "nargs" not in meta:
        spec["metavar"] = "N" if kind == "int" else "X"
    if "choices" in meta:
        spec["choices"] = [*meta["choices"], *([meta["none"]] if "none" in meta else [])]
    spec |= {key: meta[key] for key in ("nargs", "const") if key in meta}
    if default is not None:
        spec["help"] += " (default: %(default)s)"
    return spec


def options_table() -> str:
    """EngineConfig's fields as a Markdown table (docs/usage.md holds it; tools/options_table.py writes it there)."""
    rows = ["| `LLM` option | `generate` / `serve` flag | default | what it does |", "|---|---|---|---|"]
    for f in fields(C):
        default = "AdaptiveOptions()" if f.name == "adaptive" else repr(f.default)
        flags = " ".join(f"`{flag}`" for flag in _flag_names(f))
        if f.name in GENERATE_FIXED:
            flags += " (`serve`)"
        rows.append(f"| `{f.name}` | {flags} | `{default}` | {f.metadata['help'].replace('|', '/')} |")
    return "\n".join(rows)


def served_names(args) -> list[str]:
    """The names `serve`'s requests give the model: --served-model-name's, else --model as given."""
    return args.served_model_name or [args.model]


def engine_options(args, skip: tuple[str, ...] = ()) -> dict:
    """EngineConfig's fields from the flags _engine_flags made (a word that stands for None back to None)."""
    options = {}
    for f in fields(C):
        if f.name in skip:
            continue
        value = getattr(args, f.name)
        if f.name == "adaptive":
            value = dict(value)
        elif "none" in f.metadata and value == f.metadata["none"]:
            value = None
        options[f.name] = value
    return options


def _adaptive_knob(text: str) -> tuple[str, int | float]:
    """One --adaptive KNOB=VALUE, checked against the policy's knobs."""
    types = {f.name: f.type for f in fields(AdaptiveOptions)}
    knob, equals, value = text.partition("=")
    if not equals or knob not in types:
        raise argparse.ArgumentTypeError(f"expected KNOB=VALUE with one of: {', '.join(types)}")
    try:
        return knob, (int if types[knob] == "int" else float)(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{knob} takes a number ({types[knob]}), got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_plan(sub)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_measurements(bench_sub)
    _add_studies(bench_sub)
    _add_distill(sub)
    return parser


# Flags of `generate` that are not the engine's to set: it runs one sequence, which names no served adapter (--lora
# adapts it), with the sampling its own flags give
GENERATE_FIXED = ("max_num_seqs", "lora_modules", "generation_config")


def _add_generate(sub) -> None:
    """`specdecode generate`."""
    gen = sub.add_parser("generate", help="generate text with speculative decoding and print its statistics")
    # -p/--prompt as llama.cpp's tools take it (and so `--prompt TEXT` is never read as an abbreviated --prompt-lookup)
    text = gen.add_mutually_exclusive_group(required=True)
    text.add_argument(
        "prompt", nargs="?", default=argparse.SUPPRESS, help="the text to continue; - reads it from standard input"
    )
    text.add_argument("-p", "--prompt", dest="prompt", default=None, help="the text to continue, as a flag")
    _engine_flags(gen, skip=GENERATE_FIXED)
    gen.add_argument("--ngram", action="store_true", help="propose by n-gram prompt lookup (no draft model)")
    sampling = gen.add_argument_group(
        "sampling (default: greedy, so that the output is the target's own choice "
        "and speculation's speedup shows against it; the API's defaults are the model's generation config's, else "
        "temperature 1)"
    )
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--frequency-penalty", type=float, default=0.0)
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument(
        "--json-schema",
        default=None,
        metavar="JSON_OR_FILE",
        help="structured output: the text must be JSON following this schema (inline or a file)",
    )
    sampling.add_argument("--regex", default=None, help="structured output: the text must match this regex")
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--max-tokens", type=int, default=128)
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument(
        "--suffix",
        default=None,
        help="fill in the middle: the text after a gap, which the output fills after the prompt (code models with "
        "FIM tokens, such as Qwen2.5-Coder)",
    )
    gen.add_argument(
        "--compare",
        action="store_true",
        help="also run plain decoding on the same engine; print speedup and predicted speedup",
    )


def _add_serve(sub) -> None:
    """`specdecode serve` (and its Ray Serve scale-out)."""
    serve = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching")
    _engine_flags(serve)
    _http_flags(serve.add_argument_group("the server"))
    ray = serve.add_argument_group("scale-out on Ray Serve (pip install 'specdecode[ray]')")
    ray.add_argument("--ray", action="store_true", help="serve with engine replicas on Ray Serve behind one endpoint")
    ray.add_argument("--replicas", type=int, default=2, help="engine replicas (without autoscaling bounds)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas")
    ray.add_argument(
        "--target-ongoing-requests", type=float, default=None, help="autoscaling: requests per replica it aims for"
    )
    ray.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=1.0,
        help="CPUs Ray reserves for each replica (its torch threads too)",
    )
    ray.add_argument("--num-gpus-per-replica", type=float, default=None, help="GPUs Ray reserves for each replica")
    ray.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")


def _http_flags(http) -> None:
    """serve's own flags: where it listens, whom it serves and how it guards the engine."""
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=None)
    http.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the name(s) requests give the model (responses give the first); default: --model as given",
    )
    http.add_argument(
        "--max-waiting-requests",
        type=int,
        default=64,
        help="requests that may wait for a free sequence slot; beyond them the server answers 429 with Retry-After",
    )
    http.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 << 20,
        help="larger request bodies are refused (413) before they are read",
    )
    http.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="cancel a request that runs longer (504); a request may ask for less with 'timeout'",
    )
    http.add_argument(
        "--reasoning-parser",
        default=None,
        choices=list(REASONING_PARSERS),
        help="a chat reply's thinking (<think> ... </think>: Qwen3, QwQ, DeepSeek-R1; [THINK] ... [/THINK]: Magistral) "
        "goes to the message's "
        "'reasoning' field, the rest to 'content', as vLLM's parsers of these names split them",
    )
    http.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and unload adapters served by name while "
        "serving (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: a request could have the server read any file",
    )
    http.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="a chat request's chat_template (the template's text) renders it in place of the model's (vLLM's); off: "
        "such a request gets a 400",
    )
    http.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may finish (new ones get 503) before the rest are cancelled",
    )


def _add_plan(sub) -> None:
    """`specdecode plan`: the advisor."""
    plan = sub.add_parser("plan", help="advisor: calibrate, predict speedup per k and batch size, recommend")
    _add_model_args(plan)
    plan.add_argument("--k-max", type=int, default=6)
    plan.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    plan.add_argument("--num-prompts", type=int, default=3, help="HumanEval prompts for measuring acceptance")
    plan.add_argument("--max-tokens", type=int, default=64)
    plan.add_argument("--context", type=int, default=256, help="cached tokens when timing the forward passes")
    plan.add_argument("--out", default="results/plan.json")


def _add_measurements(bench_sub) -> None:
    """`bench latency`, `bench tpot`, `bench quality`, `bench serve`: one measurement each."""
    _add_latency(bench_sub)
    _add_tpot(bench_sub)
    _add_quality(bench_sub)
    _add_serve_load(bench_sub)


WORKLOAD_HELP = (
    "completion prompts (EOS ignored): humaneval, sonnet:LEN (tokens), stdlib:LEN (standard-library "
    'source of LEN tokens, for long contexts), jsonl:PATH (a "prompt" field per line) or hf:NAME; '
    "or chats that end with the reply: code-edit (standard-library functions "
    "with an edit whose answer is mostly a copy), agent-loop (sessions that ask for the whole file "
    "again with one change per turn)"
)


def _workload(spec: str) -> str:
    """A benchmark's --dataset, checked before any model loads."""
    from .bench.datasets import check_spec
    from .bench.edits import CHAT_DATASETS

    try:
        return check_spec(spec, CHAT_DATASETS)
    except SpecDecodeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_latency(bench_sub) -> None:
    lat = bench_sub.add_parser("latency", help="HumanEval, batch size 1: plain vs draft model vs n-gram")
    _add_model_args(lat, several_backends=True)
    lat.add_argument("-k", "--ks", type=int, nargs="+", default=[2, 4, 6])
    lat.add_argument("--num-prompts", type=int, default=5)
    lat.add_argument("--max-tokens", type=int, default=128)
    lat.add_argument("--no-ngram", action="store_true")
    lat.add_argument("--dataset", default="humaneval", type=_workload, help=WORKLOAD_HELP)
    lat.add_argument("--turns", type=int, default=3, help="agent-loop: turns per session (the first is not timed)")
    lat.add_argument(
        "--suffix",
        action="store_true",
        help="also measure suffix speculation (adaptive policy), alone and beside the draft model; "
        "with --vs-llama-cpp, llama.cpp's n-gram modes too",
    )
    lat.add_argument(
        "--head",
        metavar="PATH",
        default=None,
        help="also measure this draft head (a path or a bundled head's name) at each k, beside the draft model",
    )
    lat.add_argument(
        "--vs-llama-cpp",
        metavar="BIN_DIR",
        default=None,
        help="also run llama.cpp (llama-bench, llama-speculative-simple from this folder) on the "
        "same GGUF files and prompts, and print our ratios to its plain decoding",
    )
    _lora_flag(
        lat, "measure the target with these adapters (repeatable), beside a plain row of it unadapted", dtype=True
    )
    lat.add_argument("--out", default="results/latency.json")


def _add_tpot(bench_sub) -> None:
    tpot = bench_sub.add_parser(
        "tpot",
        help="plain decoding of one long output: time per output token as the "
        "output grows (emission must not slow down with length)",
    )
    tpot.add_argument("--model", default="qwen2.5-coder-0.5b")
    tpot.add_argument("--max-tokens", type=int, default=4000)
    tpot.add_argument("--window", type=int, default=100, help="tokens per TPOT measurement")
    tpot.add_argument("--device", default=None)
    tpot.add_argument("--kv-cache-dtype", default=C.kv_cache_dtype, choices=KV_CACHE_DTYPES)
    tpot.add_argument(
        "--vs-llama-cpp",
        metavar="BIN_DIR",
        default=None,
        help="also time llama.cpp's plain decoding (llama-bench from this folder) on the same file "
        "over the same stretches of context",
    )
    tpot.add_argument("--out", default="results/tpot.json")


def _add_quality(bench_sub) -> None:
    qual = bench_sub.add_parser("quality", help="top-1 agreement with the float model and perplexity, per backend")
    qual.add_argument("--model", default=DEFAULT_TARGET)
    qual.add_argument(
        "--quantization",
        nargs="+",
        default=["w4a8", "w4a16", "w8a8", "w8a16", "none", "w4a8-all"],
        choices=QUANTIZATIONS,
    )
    qual.add_argument("--dtype", default=C.dtype, help="activations of --quantization none (the reference is float32)")
    qual.add_argument(
        "--kv-cache-dtype",
        default=C.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the KV cache of the measured backends (the reference's is float32)",
    )
    qual.add_argument("--num-texts", type=int, default=16)
    qual.add_argument("--max-len", type=int, default=256, help="tokens per text")
    qual.add_argument(
        "--vs-llama-cpp",
        metavar="BIN_DIR",
        default=None,
        help="also score the held text as llama-perplexity does, with each backend and with "
        "llama.cpp's llama-perplexity from this folder on the same GGUF file",
    )
    qual.add_argument("--context", type=int, default=256, help="with --vs-llama-cpp: tokens per chunk")
    qual.add_argument("--out", default="results/quality.json")


def _add_serve_load(bench_sub) -> None:
    load = bench_sub.add_parser("serve", help="load generator against a running OpenAI-compatible server")
    load.add_argument("--base-url", default="http://127.0.0.1:8000")
    load.add_argument(
        "--model",
        default=None,
        help="model name sent in the requests (default: the one the server lists at /v1/models)",
    )
    load.add_argument("--dataset", default="humaneval", help="humaneval, sonnet:LEN, jsonl:PATH or hf:NAME")
    load.add_argument("--prompt-field", default="prompt", help="the prompt's field for jsonl/hf datasets")
    load.add_argument("--sonnet-file", default=None, help="poem text for sonnet prompts (default: the sonnets)")
    load.add_argument("--tokenizer", default=DEFAULT_TARGET, help="counts tokens when sizing sonnet prompts")
    load.add_argument("--num-prompts", type=int, default=32)
    load.add_argument("--max-tokens", type=int, default=128)
    load.add_argument("--concurrency", type=int, nargs="+", default=[1])
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--stop-at-eos", action="store_true", help="default: ignore EOS, every request runs to --max-tokens"
    )
    load.add_argument("--api-key", default=None)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--out", default="results/serve.json")


def _add_studies(bench_sub) -> None:
    """`bench report`, `bench sweep`, `bench transformers`, `bench concurrency`: studies and baselines."""
    rep = bench_sub.add_parser("report", help="plots and a Markdown report from a folder of benchmark JSON files")
    rep.add_argument("results_dir")
    rep.add_argument("--out", default=None, help="where to write report.md and the PNGs (default: results_dir)")

    sweep = bench_sub.add_parser("sweep", help="the standard study as a grid from a TOML/YAML config, then the report")
    sweep.add_argument("--config", required=True, help="e.g. configs/sweep-cpu.toml")
    sweep.add_argument("--out", default=None, help="results folder (default: the config's [sweep] out)")
    sweep.add_argument("--mode", default=None, choices=["in-process", "server"], help="override the config's mode")
    sweep.add_argument("--no-report", action="store_true", help="skip `bench report` at the end")
    _add_transformers_baseline(bench_sub)
    _add_concurrency(bench_sub)


def _add_transformers_baseline(bench_sub) -> None:
    hf = bench_sub.add_parser(
        "transformers",
        help="baseline: the batch-1 latency measurement through Hugging Face "
        "transformers (generate, assisted generation, prompt lookup)",
    )
    hf.add_argument("--model", default=DEFAULT_TARGET)
    hf.add_argument("--draft", default=DEFAULT_DRAFT)
    hf.add_argument(
        "-k", type=int, default=C.num_speculative_tokens, help="draft tokens per step (assistant and prompt lookup)"
    )
    hf.add_argument("--num-prompts", type=int, default=3)
    hf.add_argument("--max-tokens", type=int, default=128)
    hf.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    hf.add_argument("--out", default="results/transformers.json")


def _add_concurrency(bench_sub) -> None:
    conc = bench_sub.add_parser(
        "concurrency", help="through the server: plain vs fixed-k vs adaptive at each concurrency"
    )
    conc.add_argument("--model", default=DEFAULT_TARGET)
    conc.add_argument(
        "--draft",
        "--speculative-model",
        dest="draft",
        default=DEFAULT_DRAFT,
        help=f"the fixed and adaptive rows' drafter (default {DEFAULT_DRAFT}, the model llama-server's draft row "
        "uses; for a head or a lookup, that row takes the target's bundled draft model; `serve` drafts with the "
        "bundled head)",
    )
    conc.add_argument("-k", type=int, default=C.num_speculative_tokens, help="k for fixed, k_max for adaptive")
    conc.add_argument(
        "--policies",
        nargs="+",
        default=["plain", "fixed", "adaptive"],
        choices=["plain", "fixed", "adaptive", "adaptive-suffix"],
        help="adaptive-suffix: the adaptive policy with suffix speculation beside the drafter",
    )
    conc.add_argument(
        "--dataset",
        default="humaneval",
        type=_workload,
        help=WORKLOAD_HELP + "; each agent-loop reply goes into the next turn's history, one tenant per session",
    )
    conc.add_argument("--turns", type=int, default=3, help="agent-loop: turns per session")
    conc.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    conc.add_argument("--max-tokens", type=int, default=128)
    conc.add_argument("--requests-per-client", type=int, default=2)
    conc.add_argument("--min-requests", type=int, default=4)
    conc.add_argument("--rounds", type=int, default=1, help="measure each cell this many times, pooled")
    conc.add_argument("--quantization", default=C.quantization, choices=QUANTIZATIONS, help=_help("quantization"))
    _add_draft_and_cache_formats(conc)
    conc.add_argument(
        "--vs-llama-server",
        metavar="BIN_DIR",
        default=None,
        help="also drive llama.cpp's llama-server from this folder (plain, and with the draft model) "
        "on the same GGUF files through the same load generator",
    )
    conc.add_argument(
        "--once",
        nargs="*",
        default=[],
        choices=["plain", "fixed", "adaptive", "adaptive-suffix", "llama.cpp", "llama.cpp-draft"],
        help="configurations measured in the first round only",
    )
    conc.add_argument("--max-model-len", type=int, default=2048)
    conc.add_argument("--dtype", default=C.dtype)
    conc.add_argument("--out", default="results/concurrency.json")


def _cpu_gpu(option: str) -> str:
    """A distill option's two defaults, for its help."""
    cpu, gpu = getattr(R, option), GPU_RECIPE[option]
    show = (lambda v: " ".join(v)) if isinstance(cpu, list) else (lambda v: f"{v:,}")
    return f"{show(cpu)} on a CPU, {show(gpu)} on a GPU"


def _add_distill(sub) -> None:
    """`specdecode distill`."""
    dist = sub.add_parser(
        "distill",
        help="train a draft head on the target's own features (use: --draft head:OUT), "
        "or fine-tune a draft model on its outputs",
    )
    dist.add_argument("--model", default=DEFAULT_TARGET, help="the target the head drafts for")
    dist.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    dist.add_argument(
        "--quantization",
        default=C.quantization,
        choices=QUANTIZATIONS,
        help="the target's backend while recording its features: the one it will serve with",
    )
    _lora_flag(dist, "LoRA adapters on the target (repeatable): the head drafts for the adapted target")
    dist.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="text the target reads: completions:NAME (the target's own completions of prompts: "
        "stdlib = the standard library's function signatures and docstrings, python = the same "
        "from the installed packages too, humaneval, "
        "jsonl:FILE with a 'prompt' field), stdlib (this Python's own top-level modules), "
        "python (the source of its standard library and installed packages; python:N another "
        "sample of its files), sonnets, "
        "humaneval, jsonl:FILE (a 'text' field per line); default: " + _cpu_gpu("sources"),
    )
    _add_distill_recipe(dist)
    dist.add_argument(
        "--out",
        required=True,
        help="OUT.safetensors and OUT.json are written (a head), or the folder OUT (--draft-model)",
    )


def _add_distill_recipe(dist) -> None:
    """How much `distill` records and how it trains (the recipe's defaults, by device)."""
    dist.add_argument("--tokens", type=int, default=None, help="tokens of text to record; " + _cpu_gpu("tokens"))
    dist.add_argument("--completions", type=int, default=R.completions, help="prompts completed per completions source")
    dist.add_argument(
        "--completion-tokens", type=int, default=R.completion_tokens, help="new tokens per completion at most"
    )
    dist.add_argument("--chunk", type=int, default=R.chunk, help="tokens per training sequence")
    dist.add_argument("--steps", type=int, default=None, help=_cpu_gpu("steps"))
    dist.add_argument("--batch", type=int, default=None, help="sequences per step; " + _cpu_gpu("batch"))
    dist.add_argument("--lr", type=float, default=R.lr)
    dist.add_argument(
        "--draft-vocab-size",
        type=int,
        default=R.draft_vocab_size,
        help="the head's LM head keeps the target's most chosen tokens on the data",
    )
    dist.add_argument("--intermediate-size", type=int, default=R.intermediate_size, help="the head layer's MLP width")
    dist.add_argument(
        "--init",
        default=None,
        metavar="HEAD",
        help="train on from this head (a path or a bundled head's name, e.g. qwen2.5-coder-1.5b): "
        "its weights and draft vocabulary, which --draft-vocab-size and --intermediate-size "
        "then do not change",
    )
    dist.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="time budget of a head's run: on a slower machine it records less text and trains "
        "proportionally fewer steps to end in about this time (0: the whole recipe); " + _cpu_gpu("minutes"),
    )
    dist.add_argument(
        "--draft-model",
        default=None,
        help="fine-tune this draft model (sharing the target's tokenizer) on the same recording "
        "instead of training a head: OUT is then a checkpoint folder (use: --draft OUT)",
    )
    dist.add_argument("--finetune-steps", type=int, default=R.finetune_steps, help="with --draft-model")
    dist.add_argument("--finetune-lr", type=float, default=R.finetune_lr, help="with --draft-model")


# Each command's runner, imported only when that command runs (the server's and benchmarks' imports are heavy).
RUNNERS = {
    "generate": "generate_cmd:run_generate",
    "serve": "server.serve_cmd:run_serve",
    "distill": "distill.command:run_distill_cli",
    "plan": "bench.advisor:run_advisor_cli",
    "bench latency": "bench.latency:run_latency_cli",
    "bench tpot": "bench.tpot:run_tpot_cli",
    "bench quality": "bench.quality:run_quality_cli",
    "bench serve": "bench.load:run_bench_serve_cli",
    "bench report": "bench.report:run_report_cli",
    "bench sweep": "bench.sweep:run_sweep_cli",
    "bench transformers": "bench.hf_baseline:run_hf_baseline_cli",
    "bench concurrency": "bench.concurrency:run_concurrency_cli",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    args = build_parser().parse_args(argv)
    command = args.command if args.command != "bench" else f"bench {args.bench_command}"
    module, function = RUNNERS[command].split(":")
    if args.command == "bench":
        # a benchmark stops the servers it started on its way out: make SIGTERM take that way (its default
        # ends the process at once and leaves them running)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)(args)
    except SpecDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
