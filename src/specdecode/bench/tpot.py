"""Time per output token as one output grows: plain decoding of a single long request, timed per window
of tokens. The weights' cost per token is constant, so what grows is attention over the longer context
and any per-token work on the whole output (detokenization, stop strings, penalties), which must not.

A host's speed drifts by several percent over the minutes one long output takes, so each window of the
long output is paired with a window of a short request decoded right after it, on a second engine that
shares the weights: the ratio of each pair is taken a few seconds apart."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..config import EngineConfig as C
from ..engine.llm import LLM
from ..models.loader import load_model
from ..models.sources import resolve
from ..sampling import SamplingParams
from .datasets import humaneval_prompts
from .llama_cpp import run_llama_decode_at_depths
from .results import command_line, describe_machine, machine_info, write_json

SHORT_FROM, SHORT_TO = 100, 600  # the short request's timed stretch of output tokens


@dataclass
class Window:
    tokens: int  # output tokens at the window's end
    tpot_s: float  # mean seconds per token over the window
    forward_s: float  # of which the model's forward (timed inside the same steps)


class TimedRequest:
    """One plain greedy request of `max_tokens` (a stop string checked every token, never matching) on an
    engine of its own, stepped a window of tokens at a time."""

    def __init__(self, llm: LLM, prompt_ids: list[int], max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=["\x00never\x00"])
        self.llm = llm
        self.seq = llm.engine.add_request(prompt_ids, params)
        llm.engine.step()  # the prefill: its first token

    @property
    def tokens(self) -> int:
        return self.seq.num_output_tokens

    def run(self, window: int) -> Window | None:
        """Decodes `window` more tokens (at least); None where the request ends first."""
        engine, timer = self.llm.engine, self.llm.engine.timer
        mark, start, forward = self.tokens, time.perf_counter(), timer.target_time
        while self.tokens - mark < window:
            if not engine.has_unfinished():
                return None
            engine.step()
        tokens = self.tokens - mark
        return Window(self.tokens, (time.perf_counter() - start) / tokens, (timer.target_time - forward) / tokens)

    def abort(self) -> None:
        self.llm.engine.abort(self.seq)


def tpot_by_window(llm: LLM, prompt: str, max_tokens: int, window: int) -> list[Window]:
    """Every full window of one long output, in order."""
    request, rows = TimedRequest(llm, llm.tokenizer.encode(prompt), max_tokens), []
    while (row := request.run(window)) is not None:
        rows.append(row)
    return rows


def tpot_interleaved(
    long: LLM, short: LLM, prompt_ids: list[int], max_tokens: int, window: int
) -> list[tuple[Window, Window]]:
    """Each full window of one long output on `long`, paired with a window of a short request's tokens
    SHORT_FROM..SHORT_TO decoded right after it on `short` (a fresh request once one passes SHORT_TO)."""
    request, reference, pairs = TimedRequest(long, prompt_ids, max_tokens), None, []
    while (row := request.run(window)) is not None:
        if reference is None or reference.tokens >= SHORT_TO:
            if reference is not None:
                reference.abort()
            reference = TimedRequest(short, prompt_ids, SHORT_TO + window)
            reference.run(SHORT_FROM - reference.tokens)  # not timed: the stretch starts at SHORT_FROM
        pairs.append((row, reference.run(window)))
    reference.abort()
    return pairs


def run_tpot_cli(args) -> int:
    machine = machine_info()
    prompt = humaneval_prompts(1)[0]
    target = load_model(args.model, args.device, C.dtype, True, C.quantization, kv_cache_dtype=args.kv_cache_dtype)
    long, short = (
        LLM(
            target=target,
            num_speculative_tokens=0,
            max_num_seqs=1,
            max_model_len=n + 512,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        for n in (args.max_tokens, SHORT_TO + args.window)
    )
    print(
        f"{args.model}, plain decoding, one request of {args.max_tokens} tokens (a stop string checked every "
        f"token), each window followed by one of a short request's tokens {SHORT_FROM}-{SHORT_TO} on the same "
        f"weights; {describe_machine(machine)}",
        flush=True,
    )
    prompt_ids = long.tokenizer.encode(prompt)
    pairs = tpot_interleaved(long, short, prompt_ids, args.max_tokens, args.window)
    for row, ref in pairs:
        print(
            f"tokens {row.tokens - args.window:>5}-{row.tokens:<5}  TPOT {1000 * row.tpot_s:7.2f} ms   "
            f"short request {1000 * ref.tpot_s:6.2f} ms   ratio {row.tpot_s / ref.tpot_s:.3f}",
            flush=True,
        )
    summary = summarize(pairs, args.window)
    llama = llama_cpp_at_same_depths(args, summary, len(prompt_ids)) if args.vs_llama_cpp else None
    write_json(
        args.out,
        {
            "meta": {
                "command": command_line(),
                "model": args.model,
                "max_tokens": args.max_tokens,
                "window": args.window,
                "short_tokens": [SHORT_FROM, SHORT_TO],
                "machine": machine,
            },
            "windows": [
                {
                    "tokens": row.tokens,
                    "tpot_s": row.tpot_s,
                    "forward_s": row.forward_s,
                    "short_tpot_s": ref.tpot_s,
                    "short_forward_s": ref.forward_s,
                }
                for row, ref in pairs
            ],
            "summary": summary,
            "llama_cpp": llama,
        },
    )
    return 0


def summarize(pairs: list[tuple[Window, Window]], window: int) -> dict:
    """The long output's first five windows from token 100 on (past warm-up) and its last five, each with
    the model's forward apart (what attention over the longer context costs; the rest is what the engine
    adds per token); and the last five against the short request's windows decoded between them."""
    groups = {"first": [p for p in pairs if p[0].tokens - window >= 100][:5], "last": pairs[-5:]}
    summary = {}
    for name, group in groups.items():
        tpot, forward = (sum(getattr(row, f) for row, _ in group) / len(group) for f in ("tpot_s", "forward_s"))
        summary[name] = {
            "tokens": [group[0][0].tokens - window, group[-1][0].tokens],
            "tpot_s": tpot,
            "forward_s": forward,
        }
        print(
            f"{name} windows, tokens {group[0][0].tokens - window}-{group[-1][0].tokens}: TPOT {1000 * tpot:.2f} "
            f"ms, the model's forward {1000 * forward:.2f} ms, the engine's own {1000 * (tpot - forward):.2f} ms"
        )
    first, last = summary["first"], summary["last"]
    short = sum(ref.tpot_s for _, ref in groups["last"]) / len(groups["last"])
    summary["short_between_last_s"] = short
    summary["tpot_last_over_first"] = last["tpot_s"] / first["tpot_s"]
    summary["tpot_last_over_short"] = last["tpot_s"] / short
    summary["engine_last_over_first"] = (last["tpot_s"] - last["forward_s"]) / (first["tpot_s"] - first["forward_s"])
    print(
        f"last / first windows of the long output: TPOT {summary['tpot_last_over_first']:.3f} (a minute apart), "
        f"the engine's own time per token {summary['engine_last_over_first']:.3f}\n"
        f"last windows / the short request's tokens {SHORT_FROM}-{SHORT_TO} decoded between them "
        f"({1000 * short:.2f} ms): TPOT {summary['tpot_last_over_short']:.3f}",
        flush=True,
    )
    return summary


def llama_cpp_at_same_depths(args, summary: dict, prompt_tokens: int) -> dict:
    """llama.cpp's plain decoding on the same GGUF file over the same stretches of context as our first and
    last windows (llama-bench tg after a cache filled to where each stretch starts), and the ratios."""
    import torch

    start = {name: prompt_tokens + summary[name]["tokens"][0] for name in ("first", "last")}
    span = summary["last"]["tokens"][1] - summary["last"]["tokens"][0]
    rates, repacked = run_llama_decode_at_depths(
        args.vs_llama_cpp, resolve(args.model).path, torch.get_num_threads(), span, tuple(start.values())
    )
    tpot = {name: 1 / rates[depth] for name, depth in start.items()}
    ours_vs_llama = summary["last"]["tpot_s"] / tpot["last"]
    print(
        f"llama.cpp (llama-bench tg{span} after {start['first']} and {start['last']} cached tokens, same file"
        f"{'' if repacked else ', unrepacked'}): TPOT {1000 * tpot['first']:.2f} / {1000 * tpot['last']:.2f} ms, "
        f"last / first {tpot['last'] / tpot['first']:.3f}; our TPOT at the last windows {ours_vs_llama:.2f}x "
        "llama.cpp's",
        flush=True,
    )
    return {
        "depths": start,
        "tokens": span,
        "tpot_s": tpot,
        "repacked": repacked,
        "tpot_last_over_first": tpot["last"] / tpot["first"],
        "ours_over_llama_cpp_last": ours_vs_llama,
    }
