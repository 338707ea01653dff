"""The prepared GPU check (issue 51), in one run of a few minutes on a GPU machine that cannot reach the bundled
files: the default pair's shapes (Qwen2.5-Coder 1.5B target, 0.5B draft, bf16, tied embeddings, the real
vocabulary) with random weights. Acceptance means nothing here (the draft is unrelated to the target); step
costs, the forced-accept bound, the adaptive policy against plain decoding and greedy equality do.

Each figure is printed beside the fraction of the roofline: bytes a token must read (weights, and the KV
entries it attends over) over the time it took, against the device-to-device copy bandwidth measured in the
same run (bytes read plus bytes written). Then the engine's CUDA test files run with graphs on.

    PYTHONPATH=src python3 tools/cuda_check.py --out DIR     # SMOKE=1: tiny shapes, on a CPU too

A GPU machine without network gets what its image lacks as wheels: tools/gpu_wheels.sh.
"""

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch

if not torch.cuda.is_available():  # a smoke run on a CPU: the GPU's Triton kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prompts_together import WAYS, first_tokens_prefilled  # noqa: E402 (tools/, beside this script)

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.bench.results import median_seconds  # noqa: E402
from specdecode.config import ModelConfig  # noqa: E402
from specdecode.engine.memory import kv_bytes_per_token  # noqa: E402
from specdecode.executor import runner as runner_module  # noqa: E402
from specdecode.executor.paged_attention import PagedAttention  # noqa: E402
from specdecode.executor.paged_rows import PackedRowAttention  # noqa: E402
from specdecode.executor.runner import ModelRunner  # noqa: E402
from specdecode.models.layers import Linear  # noqa: E402
from specdecode.models.loader import LoadedModel  # noqa: E402
from specdecode.models.runtime import Transformer  # noqa: E402
from specdecode.timing import now  # noqa: E402

SMOKE = bool(os.environ.get("SMOKE"))
STARTED = time.perf_counter()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
VOCAB = 512 if SMOKE else 151936
SHAPES = {  # hidden, intermediate, layers, heads (2 KV heads each)
    "target": (64, 128, 2, 4) if SMOKE else (1536, 8960, 28, 12),
    "draft": (32, 64, 1, 4) if SMOKE else (896, 4864, 24, 14),
}
PROMPT, NEW = 200, 128
MIXTURE_LAYERS = 2 if SMOKE else 4  # of random_mixture's: its step's time per layer, within the run's memory and time
TIMED_ATTEMPTS = 3  # runs a timing may take to find one with no graph captured inside (generate)
QUICK_TEST_FILES = [  # the GPU paths' own tests, run by --quick too
    "tests/test_cuda_graphs.py",
    "tests/test_gemv.py",
    "tests/test_qkv_epilogue.py",
    "tests/test_overlap.py",
    "tests/test_drafts_on_device.py",
    "tests/test_drafts_queued_ahead.py",
    "tests/test_paged_attention.py",
    "tests/test_packed_rows.py",
    "tests/test_grouped_experts.py",
    "tests/test_chunked_prefill.py",
    "tests/test_prompts_together.py",
    "tests/test_runner.py",
    "tests/test_rejection_sampler.py",
]
TEST_FILES = QUICK_TEST_FILES + [
    "tests/test_engine.py",
    "tests/test_draft_model_proposer.py",
    "tests/test_policy.py",
    "tests/test_prefix_caching.py",
]
RESULTS: dict = {}


class NumberTokenizer:
    """Token ids written as numbers: enough for an engine fed token ids."""

    def __init__(self, vocab: int):
        self.vocab_size = vocab
        self.eos_token_ids = frozenset({vocab - 1})
        self.special_ids = set(self.eos_token_ids)

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids if i not in self.eos_token_ids)


def random_model(role: str, seed: int) -> LoadedModel:
    hidden, inter, layers, heads = SHAPES[role]
    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=2,
        rope_theta=1e6,
        max_position=32768,
        qkv_bias=True,
        tie_word_embeddings=True,
    )
    return randomly_filled(cfg, role, seed)


def random_mixture(seed: int = 2) -> LoadedModel:
    """Qwen3-30B-A3B's layers (128 experts of 768, top 8, q/k norms), MIXTURE_LAYERS of them: its step's shapes."""
    hidden, heads, experts, inter = (64, 4, 8, 32) if SMOKE else (2048, 32, 128, 768)
    cfg = ModelConfig(
        arch="qwen3_moe",
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=MIXTURE_LAYERS,
        num_heads=heads,
        num_kv_heads=4,
        head_dim=128 if not SMOKE else 16,
        rope_theta=1e6,
        max_position=32768,
        qk_norm=True,
        tie_word_embeddings=True,
        num_experts=experts,
        experts_per_token=8 if not SMOKE else 2,
        normalize_expert_weights=True,
    )
    return randomly_filled(cfg, "mixture", seed)


def randomly_filled(cfg: ModelConfig, role: str, seed: int) -> LoadedModel:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.set_rotary(None, DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    weights = {}
    for name, t in model.state_dict().items():
        w = torch.randn(t.shape, generator=g, device=DEVICE, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * w
        elif name.endswith("bias"):
            w = 0.1 * w
        elif name not in ("embed_tokens.weight", "lm_head.weight"):
            w = w * t.shape[-1] ** -0.5
        weights[name] = w.to(DTYPE)
    weights["lm_head.weight"] = weights["embed_tokens.weight"]
    model.load_state_dict(weights, assign=True, strict=True)
    model.lm_head.weight = model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedModel(f"random-{role}", model.eval(), NumberTokenizer(VOCAB), cfg)


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a device-to-device copy of 1 GiB."""
    a = torch.randn(1 << (20 if SMOKE else 29), device=DEVICE, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    seconds = median_seconds(lambda: b.copy_(a), 20)
    return 2 * a.numel() * a.element_size() / seconds


def roofline(tokens_per_s: float, seqs: int, context: int, model) -> float:
    """The fraction of the copy bandwidth a decode at this rate reads: each step streams the weights once for
    `seqs` sequences, and each sequence its `context` KV entries."""
    per_token = model.weight_bytes() / seqs + context * kv_bytes_per_token(model.cfg, model.kv_dtype)
    return tokens_per_s * per_token / RESULTS["copy_bandwidth_B_s"]


MEASURE_UNTIL = math.inf  # sections that would start later are skipped: the rest of the run is the test files'


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            print(f"\n== {name}", flush=True)
            if start > MEASURE_UNTIL and fn.__name__ != "tests":
                print("   skipped: the time left is kept for the test files", flush=True)
                RESULTS.setdefault("skipped", []).append(name)
                return
            try:
                fn(*args, **kwargs)
            except Exception:  # a failing section is reported; the next ones still run
                traceback.print_exc()
                RESULTS.setdefault("failed", []).append(name)
            print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)
            save()

        return run

    return wrap


def save():
    out = os.environ.get("CHECK_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "cuda-check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


@section("device")
def device_facts():
    RESULTS["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    RESULTS["torch"] = torch.__version__
    RESULTS["copy_bandwidth_B_s"] = copy_bandwidth()
    print(
        f"{RESULTS['device']}, torch {torch.__version__}, copy bandwidth "
        f"{RESULTS['copy_bandwidth_B_s'] / 1e12:.2f} TB/s (read + written)"
    )


def _decode_runner(model, seqs: int, context: int, fixed: bool, rows: int = 1):
    runner = ModelRunner(model, seqs, context + 64, fixed_shapes=fixed)
    slots = [runner.allocate() for _ in range(seqs)]
    for s in slots:
        runner.assume_cached(s, context)
    inputs = [[1] * rows for _ in slots]
    logits = "all" if rows > 1 else "last"
    return runner, lambda: runner.forward(slots, inputs, logits)


@contextlib.contextmanager
def unfused():
    """Graph runners made inside leave the elementwise steps unfused (the first one would fuse them)."""
    saved = runner_module.fuse_elementwise
    runner_module.fuse_elementwise = lambda model: False
    try:
        yield
    finally:
        runner_module.fuse_elementwise = saved


def cublas_linear(model, cublas: bool = True):
    """The model's linear layers by cuBLAS inside (their kernels chosen at start-up set aside, executor/gemv.py): a
    runner made inside attaches none either (it attaches the timed ones unless told cuBLAS)."""
    from specdecode.executor.gemv import CHOICE

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    return kernels_inside(layers, [None] * len(layers), (CHOICE, "cublas")) if cublas else kernels_inside(layers)


@contextlib.contextmanager
def kernels_inside(modules, kernels=None, choice: tuple[str, str] | None = None):
    """Inside: these modules' kernels (one each; None: as they are) and, where given, an environment choice (name,
    value) that keeps runners made inside from attaching their own; after: both as they were."""
    saved, (name, value) = [m.kernel for m in modules], choice or (None, None)
    before = os.environ.get(name) if name else None
    if name:
        os.environ[name] = value
    for m, kernel in zip(modules, kernels if kernels is not None else saved):
        m.kernel = kernel
    try:
        yield
    finally:
        if name and before is None:
            os.environ.pop(name, None)
        elif name:
            os.environ[name] = before
        for m, kernel in zip(modules, saved):
            m.kernel = kernel


def experts_by(layers, kernels):
    """The mixture-of-experts layers' kernels inside (None: PyTorch's path); runners made inside attach none."""
    return kernels_inside(layers, kernels or [None] * len(layers), (runner_module.EXPERTS_CHOICE, "pytorch"))


@contextlib.contextmanager
def taken_prologues():
    """The linear layers' kernel taking in what comes before it where it checked (the norms before QKV, gate/up and the
    head, SwiGLU before down), rather than those as kernels of their own: whether taking them in pays."""
    from specdecode.executor import gemv

    saved, gemv.TAKES_PROLOGUES = gemv.TAKES_PROLOGUES, True
    try:
        yield
    finally:
        gemv.TAKES_PROLOGUES = saved


# The attention of each mode's captured forwards: PyTorch's (gather + SDPA), or the paged Triton kernels with a
# query head a program (executor/paged_attention.py), keys split across programs every 64 positions (/split512: every
# 512, one program a head below that), (/span128) 128 keys a load rather than 64 (one KV block); linear layers by
# cuBLAS, or (+gemv) by the kernel where start-up timing chose it (/prologues: the norms and SwiGLU before them taken
# in; /unrotated: RoPE and the cache write not in the QKV projection's)
ATTENTION = {
    "graphs": None,
    "graphs+fused": None,
    "+paged": PagedAttention(1),
    "+paged/split512": PagedAttention(1, split_keys=512),
    "+gemv": PagedAttention(1),
    "+gemv/split512": PagedAttention(1, split_keys=512),
    "+gemv/prologues": PagedAttention(1),
    "+gemv/unrotated": PagedAttention(1, in_projection=False),
    "+gemv/span128": PagedAttention(1, span=128),
}
ALL_MODES = ("eager", *ATTENTION)
QUICK_MODES = ("graphs+fused", "+paged", "+gemv", "+gemv/split512", "+gemv/prologues", "+gemv/span128")
# sequences x rows per sequence after a context (64 x 5: what a verify costs at 64 sequences once any of them drafts,
# every row of the bucket computed); a CPU (a smoke run) times one, its Triton kernels interpreted
STEP_SHAPES = (
    (
        (1, 1, PROMPT),
        (1, 5, PROMPT),
        (8, 1, PROMPT),
        (64, 1, PROMPT),
        (64, 5, PROMPT),
        (64, 1, 2000),
        (1, 1, 4096),
        (1, 5, 4096),
    )
    if DEVICE == "cuda"
    else ((1, 1, PROMPT),)
)


@section("step costs: one forward, eager / graphs / + fused elementwise steps / + paged attention kernels")
def step_costs(target, modes=ALL_MODES):
    model, rows = target.model, {}
    for mode in modes:
        with _fusions(mode), cublas_linear(model, "gemv" not in mode):
            for seqs, width, context in STEP_SHAPES:
                rows.update(_step_cost(model, mode, seqs, width, context))
    RESULTS["step_costs"] = rows


# rows of a verify at batch 1: a chain of k drafts reads k + 1 (a bucket of the next power of two), a tree of 7, 15,
# 31 or 63 drafts 8, 16, 32 or 64
VERIFY_WIDTHS = (1, 2, 4, 5, 8, 16, 32, 64) if DEVICE == "cuda" else (1, 5)


@section("a verify's cost by its rows at batch 1, graphs on (what a tree of drafts would cost against a chain)")
def verify_widths(target):
    """The engine's forward (graphs, the paged kernels, the linear layers' timed choice) at batch 1 for each number of
    rows: the cost side of trees of drafts, whose tokens a step the head's replayed steps give on a CPU
    (tools/tree_acceptance.py; docs/decisions.md#trees-of-drafts-measured-not-built). A causal verify of as many rows
    stands in for a tree's: its mask lets no row see more keys."""
    rows = {}
    with cublas_linear(target.model, False):
        for width in VERIFY_WIDTHS:
            rows.update(_step_cost(target.model, "+gemv", 1, width, PROMPT))
    RESULTS["verify_widths"] = rows


@section("the 0.5B draft's forward (a drafting round), its norms and SwiGLU apart from the linear kernel and taken in")
def draft_step_costs(draft):
    """Whether taking the norms and SwiGLU into the linear layers' kernel pays for a narrower model: the 1.5B's step
    was slower with them in (each program sums its rows' squares over K first), the 0.5B's K is 896 of 1,536."""
    rows = {}
    for mode in ("+gemv", "+gemv/prologues"):
        with _fusions(mode), cublas_linear(draft.model, False):
            for seqs in (1, 8) if DEVICE == "cuda" else (1,):
                rows.update(_step_cost(draft.model, mode, seqs, 1, PROMPT))
    RESULTS["draft_step_costs"] = rows


def _fusions(mode: str):
    """What a mode fuses otherwise: "graphs" leaves the elementwise steps unfused, "/prologues" takes the norms and
    SwiGLU into the linear layers' kernel."""
    if mode == "graphs":
        return unfused()
    return taken_prologues() if mode.endswith("/prologues") else contextlib.nullcontext()


def _step_cost(model, mode: str, seqs: int, width: int, context: int) -> dict:
    runner, step = _decode_runner(model, seqs, context, mode != "eager", width)
    if mode != "eager":
        runner._fixed.attention = ATTENTION[mode]
    seconds = median_seconds(step, 20 if mode == "eager" or DEVICE == "cpu" else 50)
    frac = roofline(seqs / seconds, seqs, context, model) if width == 1 else None
    name = f"{seqs} seq x {width} rows" + (f" after {context}" if context != PROMPT else "")
    rows = {f"{mode}, {name}": {"ms": seconds * 1e3, "roofline": frac}}
    print(
        f"{mode:15s} {name:24s}: {seconds * 1e3:7.2f} ms" + (f"  {frac:.0%} of roofline" if frac is not None else ""),
        flush=True,
    )
    if mode != "eager" and DEVICE == "cuda" and (seqs, width, context) == (1, 1, PROMPT):
        graph = next(iter(runner._fixed._entries.values())).graph
        replay = median_seconds(graph.replay, 100)
        frac, launch = roofline(1 / replay, 1, PROMPT, model), _launch_seconds(graph)
        rows[f"{mode}, replay alone, 1 seq"] = {"ms": replay * 1e3, "roofline": frac, "launch_us": launch * 1e6}
        print(
            f"{mode:15s} graph replay alone: {replay * 1e3:.2f} ms, {frac:.0%} of roofline; the host's launch call "
            f"{launch * 1e6:.0f} us",
            flush=True,
        )
        _kernel_list(mode, graph)
    return rows


def _kernel_list(name: str, graph) -> None:
    """The kernels of a graph's replay, kept under RESULTS["kernels"][name]."""
    try:  # the profiler needs CUPTI: without it the timings still stand
        RESULTS.setdefault("kernels", {})[name] = kernel_breakdown(graph.replay)
    except Exception as e:
        print(f"   no kernel list: the profiler failed ({e})")


def _launch_seconds(graph, launches: int = 50) -> float:
    """The median time the host spends in a replay's launch call, the device idle before it: what each step's
    launch adds to the host's work (a cost that may grow with the graph's kernels)."""
    seconds = []
    for _ in range(launches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        seconds.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(seconds)[len(seconds) // 2]


def kernel_breakdown(replay, replays: int = 20, shown: int = 14) -> list:
    """The kernels of one replay, by time: what a step is made of, and what fusing would save."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in kernels) / replays
    rows = [{"kernel": e.key[:70], "calls": e.count / replays, "us": e.device_time_total / replays} for e in kernels]
    print(f"   {len(rows)} kinds of kernel, {sum(r['calls'] for r in rows):.0f} launches, {total:.0f} us a replay")
    for r in rows[:shown]:
        print(f"   {r['us']:8.1f} us {r['us'] / total:4.0%} {r['calls']:5.0f}x  {r['kernel']}")
    return rows


def random_head(target):
    """A head at the shipped head's shapes, random weights: the module, and its speculative_model name."""
    from specdecode.executor.backends import prepare_head
    from specdecode.models.draft_head import HeadSpec, build_head, save_head, target_fingerprint

    spec = HeadSpec(target.name, target_fingerprint(target.model), 64 if SMOKE else 2048, min(VOCAB, 16384))
    built = build_head(spec, None, target.model, torch.arange(spec.draft_vocab_size))
    path = os.path.join(tempfile.mkdtemp(), "head")
    save_head(built, spec, path)
    return prepare_head(built), f"head:{path}"


@section("a draft head's drafting forward at batch 1 (the shipped head's shape, random weights), eager and captured")
def head_step(target):
    """A draft round of the head costs c of a target step: eager, every kernel launched from Python; captured, one
    replay. Drafting k tokens costs k rounds, so c decides how far the head's acceptance carries."""
    head, head_name = random_head(target)
    features = [torch.randn(1, target.config.hidden_size, device=DEVICE, dtype=head.dtype)]
    plain = median_seconds(_decode_runner(target.model, 1, PROMPT, True)[1], 50)
    rows = {"target step ms": plain * 1e3}
    for fixed in (False, True):
        runner, round_ = _head_round(head, features, fixed)
        seconds = median_seconds(round_, 50)
        name = "captured" if fixed else "eager"
        rows[name] = {"ms": seconds * 1e3, "c": seconds / plain}
        print(
            f"head {name:8s}: {seconds * 1e3:6.3f} ms a round, c = {seconds / plain:.3f} of a target step", flush=True
        )
        if fixed and DEVICE == "cuda":  # what a round's replay is made of: its weights are a few microseconds' reading
            _kernel_list("head round", next(iter(runner._fixed._entries.values())).graph)
    for chained in (False, True):  # k = 4 greedy drafts: a round, then three more from the host or chained
        drafts = _head_drafts(head, features, 4, chained)
        seconds = median_seconds(drafts, 50)
        name = "k=4 chained" if chained else "k=4 one by one"
        rows[name] = {"ms": seconds * 1e3, "c": seconds / plain}
        print(f"head {name:14s}: {seconds * 1e3:6.3f} ms for 4 drafts, {seconds / plain:.3f} of a target step")
        if chained and DEVICE == "cuda":  # the first round's pick and three rounds in one replay
            _kernel_list("head chain", next(iter(drafts.runner._rounds._chains.values())).graph)
    rows["engine"] = _head_through_engine(target, head_name)
    RESULTS["head_step"] = rows


# Acceptance per position at k = 4 of the real pair (the shipped head, the 0.5B draft) on 20 HumanEval prompts, greedy,
# 128 tokens, no confidence stop: `specdecode bench latency -k 4 --draft-confidence 0 --no-ngram` on a CPU
BENCH_DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "bench")
MEASURED_ACCEPTANCE = {
    name: os.path.join(BENCH_DOCS, f"acceptance-humaneval-{f}.json")
    for name, f in (("head", "head-k4-zen3"), ("0.5B draft", "draft-0.5b-k4-zen3"))
}


def imposed_acceptance(name: str):
    """How many of k = 4 drafts each step keeps, drawn as the real drafter `name` kept them on HumanEval."""
    from specdecode.bench.imposed import MeasuredAcceptance

    return MeasuredAcceptance.from_latency(MEASURED_ACCEPTANCE[name], 4)


@section("batch 1, HumanEval's acceptance: each step keeps drafts as the real pair kept them (measured on a CPU)")
def measured_acceptance(target, draft):
    """Issue 51's batch-1 bars (the head 2.0x plain, the 0.5B draft 1.3x) at the real shapes: random weights, each
    step keeping as many drafts as the real weights kept on HumanEval (bench/imposed.py), so that speed is the
    device's and acceptance the real models'. Fixed k = 4 and the adaptive policy (k <= 4), against plain decoding."""
    _, head = random_head(target)
    tok_s, _, spec = generate(engine(target, num_speculative_tokens=0), 1)
    rows = {"plain": {"decode_tok_s": tok_s, "phases": spec}}
    print(f"plain: {tok_s:.1f} tok/s; {said_phases(spec)}")
    drafters = {"head": dict(speculative_model=head), "0.5B draft": dict(draft=draft)}
    for (name, drafter), policy in itertools.product(drafters.items(), ("fixed", "adaptive")):
        acceptance = imposed_acceptance(name)
        options = dict(num_speculative_tokens=4, speculation_policy=policy, draft_confidence=0.0, **drafter)
        llm = engine(target, **options)
        llm.engine.forced_accept = acceptance
        ways = {policy: (True, True, True)}
        if policy == "fixed":  # the verify after the read, the drafting too, drafts read before the verify is queued
            ways[f"{policy}, verify after the read"] = (True, True, False)
            ways[f"{policy}, drafting after the read"] = (True, False, False)
            ways[f"{policy}, drafts read first"] = (False, False, False)
        for way, (on_device, queued, verify_ahead) in ways.items():
            eng = llm.engine
            eng.overlap, eng.overlap_drafting, eng.verify_ahead = on_device, queued, verify_ahead
            try:
                tok_s, _, spec = generate(llm, 1)
            except Exception:  # one way failing must not cost the others their rows: they run on a fresh engine
                traceback.print_exc()
                RESULTS.setdefault("failed", []).append(f"measured_acceptance: {name}, {way}")
                llm = engine(target, **options)
                llm.engine.forced_accept = acceptance
                continue
            ratio = tok_s / rows["plain"]["decode_tok_s"]
            rows[f"{name}, {way}"] = {"decode_tok_s": tok_s, "vs_plain": ratio, "phases": spec}
            print(
                f"{name:10s} {way:24s}: {tok_s:8.1f} tok/s = {ratio:.2f}x plain (kept {acceptance.mean_accepted:.2f} "
                f"of 4 drafts a step on average)\n   {said_phases(spec)}",
                flush=True,
            )
        del llm
    RESULTS["measured_acceptance"] = rows


@section("the host's waits for the device, a step (PyTorch's sync debug mode): plain queued ahead, the head at k = 4")
def waits(target, steps: int = 24):
    """Every operation that makes the host wait for the device, counted per engine step and located: a plain step
    queued ahead should wait on its tokens' copy alone (an event, which the debug mode does not count), a greedy
    speculative step once, for its drafts and the target's argmax together, a sampled one twice (its drafts, read
    while the verify runs, then its verification)."""
    if DEVICE != "cuda":
        print("   (only a GPU's host waits: nothing to count)")
        return
    _, head = random_head(target)
    speculating = dict(speculative_model=head, num_speculative_tokens=4, speculation_policy="fixed")
    configs = {
        "plain, queued ahead": (dict(num_speculative_tokens=0), 0.0),
        "head k=4, forced accept": (speculating, 0.0),
        "head k=4, sampled": (speculating, 0.8),
    }
    for name, (options, temperature) in configs.items():
        llm = engine(target, draft_confidence=0.0, **options)
        llm.engine.forced_accept = "head" in name
        counts, where = _waits_a_step(llm.engine, steps, temperature)
        print(f"{name:24s}: {sum(counts) / len(counts):.2f} waits a step ({counts})")
        for place, n in where.most_common(8):
            print(f"   {n:4d}  {place}")
        RESULTS.setdefault("waits", {})[name] = {"per_step": counts, "where": dict(where.most_common(12))}
        del llm


def _waits_a_step(eng, steps: int, temperature: float = 0.0):
    import collections
    import warnings

    params = SamplingParams(temperature=temperature, seed=0, max_tokens=steps * 6, ignore_eos=True)
    eng.add_request(list(range(1, PROMPT)), params)
    for _ in range(6):  # the prefill, the first plain steps, every bucket's capture
        eng.step()
    counts, where = [], collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(steps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                eng.step()
            found = [w for w in caught if "synchroniz" in str(w.message)]
            counts.append(len(found))
            where.update(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in found)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return counts, where


def _head_through_engine(target, name: str) -> dict:
    """Batch 1 through the engine with the head at k = 4, every draft accepted (the bound its cost allows: a random
    head accepts nothing), its rounds chained and queued behind the verify before it with the next verify behind
    them, the same with the next verify after the read, chained after the read, and one by one, beside plain
    decoding."""
    from unittest import mock

    from specdecode.proposers.draft_head import DraftHeadProposer

    rows = {"plain": generate(engine(target, num_speculative_tokens=0), 1)[0]}
    ways = {"queued": (True, True, True), "drafts queued": (True, True, False), "chained": (True, False, False)}
    for key, (chained, queued, verify_ahead) in {**ways, "one by one": (False, False, False)}.items():
        with mock.patch.object(DraftHeadProposer, "chains_rounds", chained):
            options = dict(num_speculative_tokens=4, speculation_policy="fixed", forced_accept=True)
            llm = engine(target, speculative_model=name, **options)
            llm.engine.overlap_drafting, llm.engine.verify_ahead = queued, verify_ahead
            rows[key] = generate(llm, 1)[0]
            del llm  # one engine's KV cache on the device at a time
    for key, tok_s in rows.items():
        print(f"engine, head k=4 forced accept, {key:13s}: {tok_s:8.1f} tok/s = {tok_s / rows['plain']:.2f}x plain")
    return rows


def _head_round(head, features, fixed: bool):
    runner = ModelRunner(head, 1, PROMPT + 64, fixed_shapes=fixed)
    slot = runner.allocate()
    runner.assume_cached(slot, PROMPT)
    return runner, lambda: runner.forward([slot], [[1]], "last", hidden=True, features=features)


def _head_drafts(head, features, k: int, chained: bool):
    """k greedy drafts at bucket shapes (captured on a GPU), each copied to the host: after the first round, the rest
    round by round from the host or chained on the device (ModelRunner.chained_rounds)."""
    runner = ModelRunner(head, 1, PROMPT + 64, fixed_shapes=True)
    slot = runner.allocate()
    runner.assume_cached(slot, PROMPT)

    def drafts():
        logits, estimate = runner.forward([slot], [[1]], "last", hidden=True, features=features)
        runner.commit(slot, PROMPT + 1)
        if chained:
            tokens, probs, _ = runner.chained_rounds([slot], logits, estimate, [k - 1])
            torch.stack([tokens.double(), probs.double()]).tolist()
            runner.commit(slot, PROMPT + k)
        else:
            for _ in range(k - 1):
                token = int(logits[0].argmax())
                logits, estimate = runner.forward([slot], [[token]], "last", hidden=True, features=[estimate])
                runner.commit(slot, runner.length(slot) + 1)
        runner.rollback(slot, PROMPT)

    drafts.runner = runner
    return drafts


@section("batch 1 through the engine: a step's wall time against the device's busy time in it (plain, the head)")
def engine_trace(target, tokens: int = 160):
    """What separates the engine's time a step from a replay's, for plain decoding and for the head at HumanEval's
    acceptance (k = 4, imposed): the device's busy time a step (every kernel and copy the profiler saw, the prompt's
    prefill among them: under 2% of it) and the host's operations by their own time (waits for the device show as
    synchronisations and copies to the host)."""
    llm = engine(target, num_speculative_tokens=0)
    _timed(llm, 1, 8, 1)  # warm-up: the buckets' graphs captured
    llm.engine.overlap = True  # the default where graphs replay (forced on a CPU, to run the same code)
    unprofiled = generate(llm, 1, tokens)[0]
    llm.engine.overlap = False  # each step's forward queued once the step before it is on the host
    one_after_another = generate(llm, 1, tokens)[0]
    llm.engine.overlap = True
    print(
        f"plain steps queued ahead {1e3 / unprofiled:.2f} ms a token, one after another {1e3 / one_after_another:.2f}"
        f" ms ({unprofiled / one_after_another:.2f}x; {roofline(unprofiled, 1, PROMPT + tokens // 2, target.model):.0%}"
        f" of roofline)",
        flush=True,
    )
    RESULTS["engine_trace"] = {"unprofiled_ms": 1e3 / unprofiled, "one_after_another_ms": 1e3 / one_after_another}
    RESULTS["engine_trace"]["plain"] = _traced(llm, tokens, "plain")
    _, head = random_head(target)
    options = dict(speculation_policy="fixed", draft_confidence=0.0, speculative_model=head)
    drafting = engine(target, num_speculative_tokens=4, **options)
    drafting.engine.forced_accept = imposed_acceptance("head")
    generate(drafting, 1, tokens)  # its buckets met at the traced run's length
    RESULTS["engine_trace"]["head"] = _traced(drafting, tokens, "the head, k = 4, HumanEval's acceptance imposed")
    drafting.engine.verify_ahead = False  # each step's verify queued once the verify before it is read
    generate(drafting, 1, tokens)
    RESULTS["engine_trace"]["head_verify_after_the_read"] = _traced(drafting, tokens, "the same, verify after the read")
    drafting.engine.overlap_drafting = False  # each step's drafting queued once the verify before it is read
    generate(drafting, 1, tokens)
    name = "the same, drafting after the read"
    RESULTS["engine_trace"]["head_drafting_after_the_read"] = _traced(drafting, tokens, name)


def _traced(llm: LLM, tokens: int, name: str) -> dict | None:
    """One batch-1 run under the profiler: its wall time and the device's busy time a step, and the host's own time a
    step by operation (None where the profiler fails: it needs CUPTI for the device's side)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    llm.engine.timer.reset()
    try:
        with profile(activities=activities) as prof:
            seconds, _ = _timed(llm, 1, tokens, 2)
    except Exception as e:
        print(f"   {name}: no trace, the profiler failed ({e})")
        return None
    steps, events = max(1, llm.engine.timer.target_calls), prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / steps
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]
    print(f"{name}, profiled: {steps} steps, {seconds * 1e3 / steps:.2f} ms a step, the device busy "
          f"{busy / 1e3:.2f} ms of it; the host's own time by operation, a step:")  # fmt: skip
    for e in host:
        print(f"   {e.self_cpu_time_total / steps:8.1f} us {e.count / steps:6.1f}x  {e.key[:70]}")
    return {
        "steps": steps,
        "profiled_ms_a_step": seconds * 1e3 / steps,
        "device_busy_ms_a_step": busy / 1e3,
        "host": [{"op": e.key[:70], "us": e.self_cpu_time_total / steps, "calls": e.count / steps} for e in host],
    }


@section("sampled decoding (temperature 0.8), 32 sequences: plain queued ahead, one pass, one by one; greedy; the head")
def sampled(target, batch: int = 32, tokens: int = 64):
    """Plain sampled steps queued ahead (each draws its tokens on the device: engine/overlap.py, the rows' distributions
    a call per setting); one after another, verified in one pass with one copy to the host (verify/together.py);
    one by one, each sequence's draw a copy of its own, each waiting on the device; greedy, queued ahead, for what
    sampling costs; and sampled speculation with the head, its rounds chained and one by one."""
    from specdecode.engine import overlap as verifying

    llm, rates = engine(target, num_speculative_tokens=0), {}
    together = verifying.verify_batch
    ways = {"queued ahead": (True, True), "one pass": (False, True), "one by one": (False, False)}
    for name, (queued, way) in ways.items():
        llm.engine.overlap = queued
        verifying.verify_batch = functools.partial(together, together=way)
        try:
            rates[name] = generate(llm, batch, tokens, temperature=0.8)[0]
        finally:
            verifying.verify_batch = together
        print(f"{name:12s}: {rates[name]:8.1f} tok/s", flush=True)
    llm.engine.overlap = True
    rates["greedy"] = generate(llm, batch, tokens)[0]
    print(f"{'greedy':12s}: {rates['greedy']:8.1f} tok/s")
    print(
        f"queued ahead / one pass / one by one / greedy: 1 / {rates['one pass'] / rates['queued ahead']:.3f} / "
        f"{rates['one by one'] / rates['queued ahead']:.3f} / {rates['greedy'] / rates['queued ahead']:.3f}"
    )
    del llm
    rates.update(_sampled_head(target, batch, tokens))
    RESULTS["sampled"] = rates


def _sampled_head(target, batch: int, tokens: int) -> dict:
    """Sampled speculation with a random head at k = 4, every draft kept (what drafting costs, not what it earns),
    its rounds chained on the device (each row drawing at uniforms drawn beforehand) and one by one (a copy a round)."""
    from unittest import mock

    from specdecode.proposers.draft_head import DraftHeadProposer

    _, name = random_head(target)
    rates = {}
    for chained in (True, False):
        with mock.patch.object(DraftHeadProposer, "chains_rounds", chained):
            options = dict(num_speculative_tokens=4, speculation_policy="fixed", forced_accept=True)
            llm = engine(target, speculative_model=name, **options)
            key = f"head k=4 forced, {'chained' if chained else 'one by one'}"
            rates[key] = generate(llm, batch, tokens, temperature=0.8)[0]
            del llm
        print(f"{key:30s}: {rates[key]:8.1f} tok/s", flush=True)
    return rates


@section("the linear layers' kernel at a few rows (executor/gemv.py): each shape's configurations against cuBLAS")
def gemv_choice(target):
    """What start-up timed for each of the target's layer shapes (a draft head's too, where it has others), in µs a
    call and the weight's TB/s, and the configuration it chose; the first runner's start-up pays for the timing."""
    from specdecode.executor.gemv import TIMED_ROWS, attach_gemv

    if DEVICE != "cuda":
        print("no GPU: nothing to time")
        return
    start = time.perf_counter()
    timed = attach_gemv(target.model)
    print(f"timed in {time.perf_counter() - start:.1f} s (0 where a runner timed them before)")
    rows = {}
    for (n, k, bias, _), t in timed.items():
        weight = n * k * DTYPE.itemsize
        for name, seconds in (("cuBLAS", t.cublas), *((str(c), times) for c, times in t.configs.items())):
            shown = ", ".join(
                f"{r} rows {s * 1e6:6.1f} us {weight / s / 1e12:4.2f} TB/s" for r, s in zip(TIMED_ROWS, seconds)
            )
            print(f"{n:6d} x {k:5d}{' +bias' if bias else '      '} {name:60s}: {shown}")
        prologues = "" if t.chosen is None else ", the norm and SwiGLU taken in" if t.prologues else ", alone"
        print(f"   chosen: {t.chosen or 'cuBLAS'}{prologues}", flush=True)
        configs = {str(c): v for c, v in t.configs.items()}
        rows[f"{n}x{k}"] = {"cublas_s": t.cublas, "configs": configs, "chosen": str(t.chosen), "prologues": t.prologues}
    RESULTS["gemv"] = rows


@section("the linear layers alone, read at decode shapes: cuBLAS, and Inductor's autotuned kernels (1 row)")
def linear_costs(target, autotune_seconds: float = 60.0):
    """What each of a layer's projections and the LM head cost at 1 and 8 rows, in µs and in TB/s of weights read:
    where cuBLAS tiles a narrow projection over few of the device's cores, a kernel that splits its inner dimension
    would read faster. Inductor's max-autotune choice (its Triton templates beside cuBLAS) shows what one could gain,
    for as many projections as its compile time allows."""
    import torch.nn.functional as F

    linears = {n: m for n, m in target.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    linears["lm_head"] = target.model.lm_head
    start, rows = time.perf_counter(), {}
    for count in (1, 8):
        for name, m in linears.items():
            x = torch.randn(count, m.in_features, device=DEVICE, dtype=DTYPE)
            ways = {"cuBLAS": functools.partial(F.linear, x, m.weight, m.bias)}
            tuning = count == 1 and name != "lm_head" and time.perf_counter() - start < autotune_seconds
            if DEVICE == "cuda" and tuning:
                torch._dynamo.reset()  # each shape compiled apart, clear of the recompile limit
                tuned = torch.compile(_linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                ways["autotuned"] = functools.partial(tuned, x, m.weight, m.bias)
            for way, fn in ways.items():
                seconds = median_seconds(fn, 100)
                rate = m.weight.numel() * m.weight.element_size() / seconds
                rows[f"{name}, {count} rows, {way}"] = {"us": seconds * 1e6, "TB_s": rate / 1e12}
                print(f"{name:24s} {count} rows {way:9s}: {seconds * 1e6:8.1f} us, {rate / 1e12:5.2f} TB/s", flush=True)
    torch._dynamo.reset()
    RESULTS["linear_costs"] = rows


def _linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


@section("where a step's host time goes: the engine under cProfile, graphs on (plain at 1 and 32, adaptive at 32)")
def host_profile(target, draft):
    for name, batch, d, options in (
        ("plain", 1, None, dict(num_speculative_tokens=0)),
        ("plain", 32, None, dict(num_speculative_tokens=0)),
        ("adaptive draft k<=4", 32, draft, dict(num_speculative_tokens=4)),
    ):
        _profile(f"{name}, batch {batch}", engine(target, d, **options), batch)


def _profile(name: str, llm: LLM, batch: int):
    import cProfile
    import io
    import pstats

    _timed(llm, batch, 8, 1)
    profile = cProfile.Profile()
    profile.enable()
    seconds, outs = _timed(llm, batch, NEW, 0)
    profile.disable()
    report = io.StringIO()
    stats = pstats.Stats(profile, stream=report)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats("specdecode", 28)
    spec = outs[0].spec or {}
    print(
        f"-- {name}: {NEW} tokens in {seconds:.3f} s under the profiler, {spec.get('num_spec_steps', 0)} of "
        f"{spec.get('num_steps')} steps speculated\n{report.getvalue()}",
        flush=True,
    )
    RESULTS.setdefault("host_profile", {})[name] = {"seconds": seconds, "report": report.getvalue()[-8000:]}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (PROMPT,), generator=g).tolist() for _ in range(n)]


def engine(target, draft=None, **options) -> LLM:
    """No prefix caching: each timed run prefills its prompts, as new requests would; each prompt whole, so that all
    are in before the first decoding step (on a CPU they would otherwise be chunked beside the first ones' decoding,
    and the sweep's rates would time a mix of the two)."""
    options.setdefault("prefill_chunk_tokens", 0)
    return counting_plain_steps(
        LLM(
            target=target,
            draft=draft,
            max_model_len=1024,
            max_num_seqs=64,
            progress=False,
            prefix_caching=False,
            memory_budget="40GiB" if DEVICE == "cuda" else os.environ.get("CHECK_CPU_BUDGET"),
            **options,
        )
    )


def counting_plain_steps(llm: LLM) -> LLM:
    """The engine counts its plain steps, and those whose forward the step before queued (engine/overlap.py): a plain
    step not queued ahead leaves the device idle while the host works between two forwards."""
    eng, picked = llm.engine, llm.engine._picked
    llm.plain_steps = [0, 0]  # queued ahead, all

    def counted(seqs, start):
        ahead = eng._ahead is not None and any(row is not None for row in eng._ahead.rows(seqs))
        llm.plain_steps[0] += ahead
        llm.plain_steps[1] += 1
        return picked(seqs, start)

    eng._picked = counted
    return llm


def _timed(llm: LLM, batch: int, tokens: int, seed: int, temperature: float = 0.0):
    start = now()
    params = SamplingParams(
        temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=seed if temperature else None
    )
    outs = llm.generate(prompts(batch, seed), params)
    return now() - start, outs


def generate(llm: LLM, batch: int, tokens: int = NEW, seed: int = 0, temperature: float = 0.0):
    """(decoding tok/s, the outputs, the first request's speculation counters). Every request arrives at once
    and is prefilled whole before any decodes (engine()), so decoding runs from the last first token to the last
    finish: the tokens after each first over that span (at 64 sequences the prefill is most of a run, so timing it
    apart and subtracting would leave its noise in the rate). A run as long goes first: a bucket's keys grow with the
    context, and a shorter warm-up left the captures of the later buckets inside the timed run. A graph is captured
    when its bucket is first met, which a run's draws decide (how many drafts a step keeps, so how many rows the
    head's next round reads): a timed run that captured one is timed again, up to TIMED_ATTEMPTS runs."""
    _timed(llm, batch, tokens, seed + 1, temperature)
    for attempt in range(1, TIMED_ATTEMPTS + 1):
        captured = len(captures(llm))
        llm.engine.timer.reset()
        llm.plain_steps[:] = [0, 0]
        llm.engine.queued_drafts_taken = llm.engine.verifies_taken_ahead = 0
        seconds, outs = _timed(llm, batch, tokens, seed, temperature)
        more = captures(llm)[captured:]
        if not more:
            break
        again = "timed again" if attempt < TIMED_ATTEMPTS else "kept, none clean"
        print(f"   {len(more)} graphs captured inside the timed run, {sum(more):.2f} s: {again}", flush=True)
    specs = [o.spec for o in outs]
    first = max(s["ttft_s"] for s in specs)
    last = max(s["ttft_s"] + s["tpot_s"] * (s["num_output_tokens"] - 1) for s in specs)
    decoded = sum(s["num_output_tokens"] - 1 for s in specs)
    every = {"spec_steps_all": sum(s["num_spec_steps"] for s in specs), "steps_all": sum(s["num_steps"] for s in specs)}
    spec = dict(specs[0], **every, **phases(llm, seconds), captured_inside=len(more), timed_attempts=attempt)
    spec["last_first_token_s"] = first  # the prompts, admitted in one step, prefill together
    return decoded / (last - first), [o.outputs[0].token_ids for o in outs], spec


def phases(llm: LLM, seconds: float) -> dict:
    """Where a timed run's time went, a step (the engine's own timer, prompts' prefill included): the run's wall time,
    the target's forwards, the draft's, whole proposer calls."""
    timer, steps = llm.engine.timer, max(1, llm.engine.timer.target_calls)
    return {
        "steps": timer.target_calls,
        "wall_ms_a_step": 1e3 * seconds / steps,
        "target_ms_a_step": 1e3 * timer.target_time / steps,
        "draft_ms_a_step": 1e3 * (timer.draft_time + timer.draft_prefill_time) / steps,
        "propose_ms_a_step": 1e3 * timer.propose_time / steps,
        "plain_steps_queued_ahead": llm.plain_steps[0],
        "plain_steps": llm.plain_steps[1],
        "drafts_queued_ahead": llm.engine.queued_drafts_taken,  # steps that took drafting queued behind a verify
        "verifies_queued_ahead": llm.engine.verifies_taken_ahead,  # and their verify queued behind it too
    }


def said_phases(spec: dict) -> str:
    return (
        f"{spec['steps']} steps: {spec['wall_ms_a_step']:.2f} ms a step, the target's forwards "
        f"{spec['target_ms_a_step']:.2f}, drafting {spec['draft_ms_a_step']:.2f} (proposer calls "
        f"{spec['propose_ms_a_step']:.2f}); {spec['plain_steps_queued_ahead']} of {spec['plain_steps']} plain steps "
        f"queued ahead, {spec['drafts_queued_ahead']} steps' drafts and {spec['verifies_queued_ahead']} verifies"
    )


def captures(llm: LLM) -> list[float]:
    """The seconds of each graph an engine's runners have captured (each capture's warm-up runs included)."""
    runners = [llm.engine.runner, *(getattr(p, "runner", None) for p in llm.engine.proposers)]
    return [s for r in runners if r is not None and r._fixed is not None for s in r._fixed.capture_seconds]


@section("batch 1 through the engine: plain eager / plain graphs / the draft")
def batch_one(target, draft):
    rows = {}
    runs = {
        "plain, graphs": (None, dict(num_speculative_tokens=0)),
        "plain, graphs, steps one after another": (None, dict(num_speculative_tokens=0, overlap=False)),
        "draft k=4 fixed, forced accept (bound)": (
            draft,
            dict(num_speculative_tokens=4, forced_accept=True, speculation_policy="fixed"),
        ),
        "draft k=4 fixed": (draft, dict(num_speculative_tokens=4, speculation_policy="fixed")),
        "draft k<=4 adaptive": (draft, dict(num_speculative_tokens=4)),
    }
    for name, (d, options) in runs.items():
        overlap = options.pop("overlap", True)
        llm = engine(target, d, **options)
        llm.engine.overlap = overlap
        tok_s, _, spec = generate(llm, 1)
        frac = roofline(tok_s, 1, PROMPT + NEW // 2, target.model)
        rows[name] = {"decode_tok_s": tok_s, "roofline_plain_equiv": frac, "spec": spec}
        print(
            f"{name:42s} {tok_s:8.1f} tok/s  ({frac:.0%} of roofline as plain decoding)  steps "
            f"{spec.get('num_spec_steps', 0)} of {spec.get('num_steps', '?')} speculated",
            flush=True,
        )
        del llm
    base = rows["plain, graphs"]["decode_tok_s"]
    for name, row in rows.items():
        row["vs_plain_graphs"] = row["decode_tok_s"] / base
        print(f"{name:42s} {row['vs_plain_graphs']:.2f}x plain with graphs")
    RESULTS["batch_one"] = rows


@section("batch 1 through the engine, eager (every forward launched op by op, nothing fused)")
def batch_one_eager(target):
    tok_s = generate(engine(target, num_speculative_tokens=0, enforce_eager=True), 1, 32)[0]
    frac = roofline(tok_s, 1, PROMPT + NEW // 2, target.model)
    RESULTS["batch_one_eager"] = {"decode_tok_s": tok_s, "roofline": frac}
    print(f"plain, eager: {tok_s:.1f} tok/s ({frac:.0%} of roofline)")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _top2_gap(model, tokens: list[int]) -> float:
    runner = ModelRunner(model, 1, len(tokens) + 8, fixed_shapes=False)
    logits = runner.forward([runner.allocate()], [tokens], "last")[0]
    top = logits.topk(2).values
    return float(top[0] - top[1])


@section("greedy: speculative (draft, real verification) against plain, both with graphs")
def greedy(target, draft):
    rows = {}
    for batch in (1, 8):
        plain = generate(engine(target, num_speculative_tokens=0), batch)[1]
        spec = generate(engine(target, draft, num_speculative_tokens=4, speculation_policy="fixed"), batch)[1]
        diverged = []
        for p, a, b in zip(prompts(batch), plain, spec):
            at = _first_difference(a, b)
            if at is not None:
                diverged.append({"position": at, "top2_gap": _top2_gap(target.model, p + a[:at])})
        rows[f"batch {batch}"] = {"equal": batch - len(diverged), "of": batch, "divergences": diverged}
        print(
            f"batch {batch}: speculative greedy == plain for {batch - len(diverged)}/{batch}; divergences "
            f"(position, top-2 logit gap there): {[(d['position'], round(d['top2_gap'], 4)) for d in diverged]}",
            flush=True,
        )
    RESULTS["greedy"] = rows


@section("greedy bits at batch 1: plain against the draft verifying 5 rows a step, linear layers as timed / all Triton")
def greedy_bits(target, draft, runs: int = 4):
    """Whether a verify row gets the bits a decode row gets: random weights make near-ties everywhere, and a random
    draft has each step's token come from the first of 5 verified rows, where plain decoding computes 1. With every
    linear layer in the kernel (rows in fixed tiles) and the paged attention kernels (keys in fixed spans), none
    should diverge."""
    from specdecode.executor import gemv

    results = {}
    for choice in ("auto", "triton"):
        os.environ[gemv.CHOICE] = choice
        plain = engine(target, num_speculative_tokens=0)
        spec = engine(target, draft, num_speculative_tokens=4, speculation_policy="fixed")
        diverged = []
        for seed in range(runs):
            a, b = (_timed(llm, 1, NEW, seed)[1][0].outputs[0].token_ids for llm in (plain, spec))
            at = _first_difference(a, b)
            if at is not None:
                diverged.append({"position": at, "top2_gap": _top2_gap(target.model, prompts(1, seed)[0] + a[:at])})
        kernels = sum(m.kernel is not None for m in target.model.modules() if isinstance(m, Linear))
        results[choice] = {"equal": runs - len(diverged), "of": runs, "kernel_layers": kernels, "divergences": diverged}
        print(
            f"linear layers {choice:6s} ({kernels} by the kernel): speculative greedy == plain for "
            f"{runs - len(diverged)}/{runs}; divergences (position, top-2 gap): "
            f"{[(d['position'], round(d['top2_gap'], 4)) for d in diverged]}",
            flush=True,
        )
        del plain, spec
    os.environ.pop(gemv.CHOICE)
    for model in (target.model, draft.model) if DEVICE == "cuda" else ():  # as timed, for the sections after
        runner_module.gpu_linear_layers(model)
    RESULTS["greedy_bits"] = results


@section("concurrency sweep: plain and the adaptive policy (k<=4), the draft's own acceptance and imposed, graphs on")
def concurrency(target, draft, tokens: int, imposed: tuple[str, ...] = ("head",)):
    """Plain decoding against the adaptive policy (k <= 4) at each concurrency: "adaptive", with the random draft at
    its own acceptance (next to none: the policy should draft next to nothing and cost nothing), and "imposed, NAME"
    for each drafter named (the head, the default drafter; the 0.5B draft), each step keeping as many drafts as the
    real one kept on HumanEval (bench/imposed.py), so that what the policy gains shows at the real acceptance."""
    plain, rows = engine(target, num_speculative_tokens=0), {}
    drafting = {"adaptive": engine(target, draft, num_speculative_tokens=4)}
    for name in imposed:  # no confidence stop: a random drafter is never sure, and what is imposed is k = 4's
        drafter = dict(speculative_model=random_head(target)[1]) if name == "head" else dict(draft=draft)
        drafting[f"imposed, {name}"] = engine(target, num_speculative_tokens=4, draft_confidence=0.0, **drafter)
        drafting[f"imposed, {name}"].engine.forced_accept = imposed_acceptance(name)
    for n in (1, 2, 4, 8, 16, 32, 64):
        p_tok_s, _, p_spec = generate(plain, n, tokens)
        frac, ttft = roofline(p_tok_s, n, PROMPT + tokens // 2, target.model), p_spec["last_first_token_s"]
        rows[n], said = {"plain_decode_tok_s": p_tok_s, "plain_roofline": frac, "plain_last_first_token_s": ttft}, []
        for name, llm in list(drafting.items()):
            try:
                tok_s, _, spec = generate(llm, n, tokens)
            except Exception:  # an engine that fails is left out of the later points; the others go on
                traceback.print_exc()
                RESULTS.setdefault("failed", []).append(f"concurrency {n}: {name}")
                del drafting[name]
                continue
            steps = f"{spec['spec_steps_all']} of {spec['steps_all']}"  # every sequence's: one drafting widens a call
            rows[n][name] = {"decode_tok_s": tok_s, "ratio": tok_s / p_tok_s, "spec_steps": spec["spec_steps_all"]}
            said.append(f"{name} {tok_s:8.1f} tok/s = {tok_s / p_tok_s:.3f}x ({steps} sequence steps drafted)")
        print(f"concurrency {n:3d}: plain {p_tok_s:8.1f} tok/s ({frac:.0%} of roofline, the last first token at "
              f"{ttft:.3f} s); {'; '.join(said)}", flush=True)  # fmt: skip
        behind = next((name for name in drafting if rows[n][name]["ratio"] < 0.98), None)
        if behind:  # what differs: each one's phases and host time, the two timed the other way round
            rows[n]["again"] = dict(_again(plain, drafting[behind], n, tokens, behind), engine=behind)
    rows["plain_64_over_1"] = rows[64]["plain_decode_tok_s"] / rows[1]["plain_decode_tok_s"]
    print(f"plain throughput at 64 / at 1: {rows['plain_64_over_1']:.1f}x")
    for name, llm in (("plain", plain), *drafting.items()):  # what capturing when first met costs
        seconds, let_go = captures(llm), getattr(llm.engine.runner._fixed, "let_go", 0)
        longest = max(seconds, default=0.0)
        rows[f"{name}_captures"] = dict(graphs=len(seconds), seconds=sum(seconds), longest=longest, let_go=let_go)
        print(f"{name}: {len(seconds)} graphs captured in {sum(seconds):.2f} s (the longest {longest:.3f} s), "
              f"{let_go} of the target's let go to keep their outputs within its bound")  # fmt: skip
    RESULTS["concurrency"] = rows


@section("prompts arriving at once: the last first token, prefilled together against one forward each")
def prompts_together(target, counts=(8, 64), rounds: int = 2):
    """Plain decoding, PROMPT-token prompts arriving at once: the time to the last first token with the prompts
    prefilled together (the engine's way) and one forward each (as before it: tools/prompts_together.py), the best
    of `rounds` each, after a warm-up of each (their captures)."""
    llm, rows = engine(target, num_speculative_tokens=0), {}
    for n in counts:
        batch = prompts(n, seed=7)
        for way in WAYS:
            first_tokens_prefilled(way, llm, batch)
        best = {way: math.inf for way in WAYS}
        for way in WAYS * rounds:
            best[way] = min(best[way], first_tokens_prefilled(way, llm, batch)[1])
        rows[n] = {"together_s": best["together"], "one_each_s": best["one each"]}
        together, each = best["together"], best["one each"]
        print(f"{n:3d} prompts of {PROMPT} tokens: the last first token {together:.3f} s together, {each:.3f} s "
              f"one forward each: {each / together:.2f}x", flush=True)  # fmt: skip
    RESULTS["prompts_together"] = rows


@section(
    "packed eager forwards (a mixture of experts' steps, prompts no graph serves): PyTorch's row-by-row attention "
    "against the paged kernels (executor/paged_rows.py)"
)
def packed_eager(target, shapes=((1, 5), (64, 1), (64, 5)) if DEVICE == "cuda" else ((1, 5), (2, 1))):
    """One eager forward of `seqs` sequences x `rows` new rows after PROMPT cached tokens, attended token by token by
    PyTorch and by the kernels, and how far the two forwards' logits lie apart."""
    attentions = [layer.self_attn for layer in target.model.layers]
    results = {}
    for seqs, rows in shapes:
        runner, step = _decode_runner(target.model, seqs, PROMPT, fixed=False, rows=rows)
        attached = attentions[0].rowwise_kernel  # by a GPU's runner where the kernels passed their check
        kernel = attached if DEVICE == "cuda" else PackedRowAttention(PagedAttention())  # a CPU's smoke run: as is
        if kernel is None:
            print("no kernels attached: they failed their check, or SPECDECODE_GPU_ATTENTION=sdpa")
            return
        timed, logits = {}, {}
        for name, taken in (("pytorch", None), ("kernels", kernel)):
            for attention in attentions:
                attention.rowwise_kernel = taken
            logits[name] = step().float()
            timed[name] = median_seconds(step, 1 if DEVICE == "cpu" else 5 if taken is None else 20)
        for attention in attentions:
            attention.rowwise_kernel = attached
        apart = (logits["kernels"] - logits["pytorch"]).abs().max().item()
        results[f"{seqs}x{rows}"] = {**{f"{k}_ms": v * 1e3 for k, v in timed.items()}, "max_logit_apart": apart}
        pytorch_ms, kernels_ms = timed["pytorch"] * 1e3, timed["kernels"] * 1e3
        print(f"{seqs:2d} seq x {rows} rows: PyTorch {pytorch_ms:8.2f} ms, kernels {kernels_ms:7.2f} ms "
              f"({pytorch_ms / kernels_ms:.1f}x); logits apart {apart:.2e}", flush=True)  # fmt: skip
    RESULTS["packed_eager"] = results


@section(
    "a mixture of experts (Qwen3-30B-A3B's layers): PyTorch's experts (rows grouped on the host, eager) against the "
    "grouped kernels (executor/grouped_experts.py), eager and captured"
)
def experts(shapes=((1, 1), (8, 1), (1, 5)) if DEVICE == "cuda" else ((1, 5),)):
    """A forward of `seqs` sequences x `rows` new rows after PROMPT cached tokens, three ways, the logits compared with
    PyTorch's; at one sequence the fraction of the roofline (the step reads its chosen experts alone)."""
    loaded = random_mixture()
    model = loaded.model
    layers = [m for m in model.modules() if hasattr(m, "experts")]
    attached = runner_module.gpu_experts(model) if DEVICE == "cuda" else 0
    kernels = [m.kernel for m in layers]
    if DEVICE == "cuda" and not attached:
        print("no kernels attached: they failed their check, or SPECDECODE_GPU_EXPERTS=pytorch")
        return
    if DEVICE == "cpu":  # a smoke run: the kernels in Triton's interpreter
        from specdecode.executor.grouped_experts import GroupedExperts

        kernels = [GroupedExperts(m) for m in layers]
    expert_bytes = sum(p.numel() * p.element_size() for m in layers for p in m.experts.parameters())
    cfg = loaded.config
    read = model.weight_bytes() - expert_bytes * (1 - cfg.experts_per_token / cfg.num_experts)
    print(f"{cfg.num_layers} layers, {model.weight_bytes() / 1e9:.2f} GB, {read / 1e9:.3f} GB read by a token")
    results = {}
    for seqs, rows in shapes:
        timed, logits = {}, {}
        for name, taken, fixed in (("pytorch", None, False), ("kernels", kernels, False), ("captured", kernels, True)):
            with experts_by(layers, taken):
                runner, step = _decode_runner(model, seqs, PROMPT, fixed=fixed and DEVICE == "cuda", rows=rows)
                logits[name] = step().float()
                timed[name] = median_seconds(step, 1 if DEVICE == "cpu" else 5 if taken is None else 20)
                del runner, step
        apart = max((logits[k] - logits["pytorch"]).abs().max().item() for k in ("kernels", "captured"))
        point = {**{f"{k}_ms": v * 1e3 for k, v in timed.items()}, "max_logit_apart": apart}
        said = ", ".join(f"{k} {v * 1e3:7.2f} ms" for k, v in timed.items())
        if (seqs, rows) == (1, 1):
            point["captured_roofline"] = read / timed["captured"] / RESULTS["copy_bandwidth_B_s"]
            said += f" ({point['captured_roofline']:.0%} of the roofline)"
        results[f"{seqs}x{rows}"] = point
        print(f"{seqs:2d} seq x {rows} rows: {said}; logits apart {apart:.2e}", flush=True)
    RESULTS["experts"] = results


def _again(plain: LLM, adaptive: LLM, n: int, tokens: int, name: str = "adaptive") -> dict:
    """A sweep point where an engine with the adaptive policy (`name`) fell behind, timed again that one first, each
    run's phases and host time shown."""
    a_tok_s, _, a_spec = generate(adaptive, n, tokens)
    p_tok_s, _, p_spec = generate(plain, n, tokens)
    print(f"   again, {name} first: {a_tok_s / p_tok_s:.3f}x\n   plain: {said_phases(p_spec)}\n   {name}: "
          f"{said_phases(a_spec)}", flush=True)  # fmt: skip
    hosts = {who: _decoding_profile(who, llm, n, tokens) for who, llm in (("plain", plain), (name, adaptive))}
    return {"ratio": a_tok_s / p_tok_s, "plain": p_spec, "adaptive": a_spec, "host_us_a_step": hosts}


def _decoding_profile(name: str, llm: LLM, n: int, tokens: int, top: int = 12) -> dict[str, float]:
    """The host's own time by function over a run's decoding steps alone (its prompts prefilled before the profiler
    starts, so that their eager forwards' launches are not in it), in microseconds a step: what one engine's host
    does a step that the other's does not."""
    import cProfile
    import pstats

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for prompt in prompts(n):
        eng.add_request(prompt, params)
    while eng.waiting or eng.prefilling:
        eng.step()
    profile, steps = cProfile.Profile(), 0
    profile.enable()
    while eng.has_unfinished():
        eng.step()
        steps += 1
    profile.disable()
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda item: -item[1][2])[:top]
    said = {f"{os.path.basename(file)}:{line}({function})": 1e6 * own / max(1, steps)
            for (file, line, function), (_, _, own, _, _) in rows}  # fmt: skip
    print(f"   {name}: the host's own time in {steps} decoding steps under cProfile, us a step: " + ", ".join(
        f"{where} {us:.0f}" for where, us in said.items()), flush=True)  # fmt: skip
    return said


@section("the CUDA test files, graphs on")
def tests(files=TEST_FILES, deadline: float | None = None):
    """The test files on the device, within what is left before `deadline` (where one is set); what they printed is
    shown however they end, the slowest tests named."""
    env = dict(os.environ, SPECDECODE_TEST_DEVICE=DEVICE)
    workers = str(min(16, os.cpu_count() or 1))
    workers = ["-n", os.environ.get("TEST_WORKERS", workers)] if importlib.util.find_spec("xdist") else []
    seconds = int(os.environ.get("TEST_SECONDS", "600"))
    if deadline is not None:
        seconds = max(30, min(seconds, int(deadline - time.perf_counter())))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",  # a line a test as it ends: a run cut short still says which passed and which failed
        "-p",
        "no:cacheprovider",
        "-m",
        "not real_model and not ray",
        "--durations=12",
        *workers,
        *files,
    ]
    # a session of its own: past its time, pytest's workers are stopped with it (they would hold the device)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=seconds)
        rc = proc.returncode
    except subprocess.TimeoutExpired:  # what ran is still worth reading
        os.killpg(proc.pid, signal.SIGKILL)
        (out, err), rc = proc.communicate(), "timed out"
    counts, failed = test_outcomes(out)
    said = ", ".join(f"{n} {outcome.lower()}" for outcome, n in sorted(counts.items())) or "no test ended"
    kept = "\n".join(line for line in out.splitlines() if not OUTCOME.search(line) or "FAILED" in line)
    print(f"{seconds} s given; {rc=}; {said}", *failed, kept[-4000:], err[-2000:], sep="\n")
    RESULTS["tests"] = {"rc": rc, "seconds": seconds, "outcomes": counts, "failed": failed, "tail": kept[-600:]}
    if rc != 0:
        raise RuntimeError(f"the test files did not pass ({rc}; {said})")


OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
TEST_ID = re.compile(r"(\S+\.py::\S+)")


def test_outcomes(verbose: str) -> tuple[dict[str, int], list[str]]:
    """Each outcome's count in pytest -v's lines (a test's, with or without xdist's worker prefix; the summary names a
    failed test again), and the tests that failed or errored: what a run cut short had settled."""
    ended = {}
    for line in verbose.splitlines():
        outcome, test = OUTCOME.search(line), TEST_ID.search(line)
        if outcome and test:
            ended[test[1]] = outcome[1]
    counts = {}
    for outcome in ended.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts, [test for test, outcome in ended.items() if outcome in ("FAILED", "ERROR")]


def compiler_counts() -> None:
    """How often the elementwise kernels were compiled: a count growing with the prompts seen would mean eager
    forwards reach the compiler."""
    from torch._dynamo.utils import counters

    RESULTS["compiler_frames"] = dict(counters["frames"])
    print(f"compiler frames: {RESULTS['compiler_frames']}")
    save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--sweep-tokens", type=int, default=64, help="tokens per request in the concurrency sweep")
    parser.add_argument("--only-sweep", action="store_true", help="the device facts and the concurrency sweep alone")
    parser.add_argument(
        "--seconds", type=float, default=540, help="when the run must end: the test files get what is left of it"
    )
    parser.add_argument(
        "--test-seconds",
        type=float,
        default=0,
        help="with --quick, the time at the end kept for the test files: a measuring section that would start later "
        "is skipped (the bars come first; the test files come to a verdict whatever the measurements took)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the linear layers' kernel against cuBLAS, the batch-1 bars, the concurrency sweep, step costs (graphs, "
        "fusion, attention and linear kernels), a verify by its rows, the head's step, the waits, greedy bits, the GPU "
        "paths' tests",
    )
    args = parser.parse_args()
    if args.out:
        os.environ["CHECK_OUT"] = args.out
    if args.quick and not args.skip_tests and args.test_seconds:
        global MEASURE_UNTIL
        MEASURE_UNTIL = STARTED + args.seconds - args.test_seconds
    device_facts()
    target, draft = random_model("target", 0), random_model("draft", 1)
    print(f"target {target.model.weight_bytes() / 1e9:.2f} GB, draft {draft.model.weight_bytes() / 1e9:.2f} GB")
    if args.quick:  # the bars first (a run may be cut short), then what explains them
        gemv_choice(target)
        measured_acceptance(target, draft)
        concurrency(target, draft, args.sweep_tokens)  # the default drafter's acceptance imposed
        prompts_together(target)
        packed_eager(target)
        experts()
        step_costs(target, QUICK_MODES)
        verify_widths(target)
        draft_step_costs(draft)
        head_step(target)
        waits(target)
        engine_trace(target)
        greedy_bits(target, draft)
        compiler_counts()
        if not args.skip_tests:
            tests(QUICK_TEST_FILES, deadline=STARTED + args.seconds)
        return
    if not args.only_sweep:
        batch_one_eager(target)
        packed_eager(target)
        experts()
        step_costs(target)
        verify_widths(target)
        batch_one(target, draft)
        waits(target)
        measured_acceptance(target, draft)
        sampled(target)
        host_profile(target, draft)
        greedy(target, draft)
    concurrency(target, draft, args.sweep_tokens, imposed=("head", "0.5B draft"))
    if not args.skip_tests:
        tests()
    compiler_counts()
    print(json.dumps({k: v for k, v in RESULTS.items() if k in ("device", "failed")}))


if __name__ == "__main__":
    main()
