"""Time per output token as one output grows: plain decoding of a single long request, timed per window
of tokens. The weights' cost per token is constant, so what grows is attention over the longer context
and any per-token work on the whole output (detokenization, stop strings, penalties), which must not."""
from __future__ import annotations

import time

from ..engine.llm import LLM
from ..models.sources import resolve
from ..sampling import SamplingParams
from .datasets import humaneval_prompts
from .llama_cpp import run_llama_decode_at_depths
from .results import command_line, describe_machine, machine_info, write_json


def tpot_by_window(llm: LLM, prompt: str, max_tokens: int, window: int) -> list[tuple[int, float, float]]:
    """(output tokens so far, mean seconds per token, mean seconds of the model's forward per token) over the
    `window` tokens before, for each window: the forward timed inside the same steps, so that the rest is
    what the engine adds per token."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=["\x00never\x00"])
    seq = llm.engine.add_request(llm.tokenizer.encode(prompt), params)
    timer = llm.engine.timer
    llm.engine.step()  # prefill and the first decode step
    rows, mark, mark_time, mark_forward = [], seq.num_output_tokens, time.perf_counter(), timer.target_time
    while llm.engine.has_unfinished():
        llm.engine.step()
        tokens = seq.num_output_tokens - mark
        if tokens >= window:
            now = time.perf_counter()
            forward = timer.target_time - mark_forward
            rows.append((seq.num_output_tokens, (now - mark_time) / tokens, forward / tokens))
            mark, mark_time, mark_forward = seq.num_output_tokens, now, timer.target_time
    return rows


def run_tpot_cli(args) -> int:
    machine = machine_info()
    prompt = humaneval_prompts(1)[0]
    llm = LLM(model=args.model, num_speculative_tokens=0, device=args.device, max_num_seqs=1,
              kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=args.max_tokens + 512)
    print(f"{args.model}, plain decoding, one request of {args.max_tokens} tokens (a stop string checked "
          f"every token); {describe_machine(machine)}", flush=True)
    rows = tpot_by_window(llm, prompt, args.max_tokens, args.window)
    for tokens, seconds, _ in rows:
        print(f"tokens {tokens - args.window:>5}-{tokens:<5}  TPOT {1000 * seconds:7.2f} ms", flush=True)
    summary = summarize(rows, args.window)
    first, last = summary["first"], summary["last"]
    ratio = last["tpot_s"] / first["tpot_s"]
    engine_ratio = (last["tpot_s"] - last["forward_s"]) / (first["tpot_s"] - first["forward_s"])
    print(f"last / first: TPOT {ratio:.3f}, the engine's own time per token {engine_ratio:.3f}")
    llama = None
    if args.vs_llama_cpp:
        llama = llama_cpp_at_same_depths(args, summary, len(llm.tokenizer.encode(prompt)))
    write_json(args.out, {"meta": {"command": command_line(), "model": args.model, "max_tokens": args.max_tokens,
                                   "window": args.window, "machine": machine},
                          "windows": [{"tokens": t, "tpot_s": s, "forward_s": f} for t, s, f in rows],
                          "summary": summary, "llama_cpp": llama,
                          "tpot_last_over_first": ratio, "engine_last_over_first": engine_ratio})
    return 0


def summarize(rows: list[tuple[int, float, float]], window: int) -> dict[str, dict]:
    """The first and the last five windows (from token 100 on: past warm-up), with the model's forward timed
    in the same steps: what attention over the longer context costs, so that what the engine adds per token
    (sampling, emission, detokenization) shows apart."""
    groups = {"first": [r for r in rows if r[0] - window >= 100][:5], "last": rows[-5:]}
    summary = {}
    for name, group in groups.items():
        tpot, forward = (sum(r[i] for r in group) / len(group) for i in (1, 2))
        summary[name] = {"tokens": [group[0][0] - window, group[-1][0]], "tpot_s": tpot, "forward_s": forward}
        print(f"{name} windows, tokens {group[0][0] - window}-{group[-1][0]}: TPOT {1000 * tpot:.2f} ms, "
              f"the model's forward {1000 * forward:.2f} ms, the engine's own {1000 * (tpot - forward):.2f} ms")
    return summary


def llama_cpp_at_same_depths(args, summary: dict[str, dict], prompt_tokens: int) -> dict:
    """llama.cpp's plain decoding on the same GGUF file over the same stretches of context as our first and
    last windows (llama-bench tg after a cache filled to where each stretch starts), and the ratios."""
    import torch

    start = {name: prompt_tokens + group["tokens"][0] for name, group in summary.items()}
    span = summary["last"]["tokens"][1] - summary["last"]["tokens"][0]
    rates, repacked = run_llama_decode_at_depths(args.vs_llama_cpp, resolve(args.model).path,
                                                 torch.get_num_threads(), span, tuple(start.values()))
    tpot = {name: 1 / rates[depth] for name, depth in start.items()}
    ours_vs_llama = summary["last"]["tpot_s"] / tpot["last"]
    print(f"llama.cpp (llama-bench tg{span} after {start['first']} and {start['last']} cached tokens, same file"
          f"{'' if repacked else ', unrepacked'}): TPOT {1000 * tpot['first']:.2f} / {1000 * tpot['last']:.2f} ms, "
          f"last / first {tpot['last'] / tpot['first']:.3f}; our TPOT at the last windows {ours_vs_llama:.2f}x "
          "llama.cpp's", flush=True)
    return {"depths": start, "tokens": span, "tpot_s": tpot, "repacked": repacked,
            "tpot_last_over_first": tpot["last"] / tpot["first"], "ours_over_llama_cpp_last": ours_vs_llama}
