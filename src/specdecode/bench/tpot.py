"""Time per output token as one output grows: plain decoding of a single long request, timed per window
of tokens. The weights' cost per token is constant, so what grows is attention over the longer context
and any per-token work on the whole output (detokenization, stop strings, penalties), which must not."""
from __future__ import annotations

import time

from ..engine.llm import LLM
from ..sampling import SamplingParams
from .datasets import humaneval_prompts
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
    # the first and the last five windows (from token 100 on: past warm-up), with the model's forward timed in
    # the same steps: what attention over the longer context costs, so that what the engine adds per token
    # (sampling, emission, detokenization) shows apart
    groups = {"first": [r for r in rows if r[0] - args.window >= 100][:5], "last": rows[-5:]}
    summary = {}
    for name, group in groups.items():
        tpot, forward = (sum(r[i] for r in group) / len(group) for i in (1, 2))
        summary[name] = {"tokens": [group[0][0] - args.window, group[-1][0]], "tpot_s": tpot, "forward_s": forward}
        print(f"{name} windows, tokens {group[0][0] - args.window}-{group[-1][0]}: TPOT {1000 * tpot:.2f} ms, "
              f"the model's forward {1000 * forward:.2f} ms, the engine's own {1000 * (tpot - forward):.2f} ms")
    first, last = summary["first"], summary["last"]
    ratio = last["tpot_s"] / first["tpot_s"]
    engine_ratio = (last["tpot_s"] - last["forward_s"]) / (first["tpot_s"] - first["forward_s"])
    print(f"last / first: TPOT {ratio:.3f}, the engine's own time per token {engine_ratio:.3f}")
    write_json(args.out, {"meta": {"command": command_line(), "model": args.model, "max_tokens": args.max_tokens,
                                   "window": args.window, "machine": machine},
                          "windows": [{"tokens": t, "tpot_s": s, "forward_s": f} for t, s, f in rows],
                          "summary": summary,
                          "tpot_last_over_first": ratio, "engine_last_over_first": engine_ratio})
    return 0
