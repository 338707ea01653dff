"""Greedy continuations of a GGUF model by specdecode and by llama.cpp's llama-server on the same file and
prompts: how many tokens agree, and where they part, the gap between our top two logits there (a near-tie
is where two correct implementations may choose differently).

    python tools/greedy_vs_llama_cpp.py --model gemma3-270m --bin BIN [--quantization w4a8]
        [--server-args "-fa off"] PROMPT...

llama-server's CPU flash attention (on by default) sums the weighted values in float16; "-fa off" sums them in
float32, as this engine does (docs/families.md).
"""

from __future__ import annotations

import argparse
import functools
import shlex

import httpx

from specdecode import LLM, SamplingParams
from specdecode.bench.results import describe_machine, machine_info
from specdecode.bench.server_process import llama_server
from specdecode.executor.runner import ModelRunner
from specdecode.models.sources import resolve


def llama_cpp_greedy(bin_dir: str, gguf: str, prompts: list[list[int]], tokens: int, server_args: list[str]):
    """llama-server's greedy continuations of each prompt, as our tokenizer gave it (BOS included: both models read
    the same ids)."""
    fields = dict(n_predict=tokens, temperature=0, top_k=1, cache_prompt=False, return_tokens=True, ignore_eos=True)
    with llama_server(bin_dir, gguf, slots=1, context=2048, threads=2, extra=tuple(server_args)) as server:
        post = functools.partial(httpx.post, f"{server.base_url}/completion", timeout=600)
        return [post(json=dict(fields, prompt=ids)).json()["tokens"] for ids in prompts]


def top_two_gap(llm: LLM, ids: list[int]) -> float:
    model = llm.engine.target.model if hasattr(llm.engine, "target") else llm.target.model
    runner = ModelRunner(model, 1, len(ids) + 1)
    logits = runner.forward([runner.allocate()], [ids], "last")[0]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--model", required=True)
    parser.add_argument("--bin", required=True, help="the folder build-llama-cpp.sh printed")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--server-args", default="", help="more llama-server options, e.g. '-fa off'")
    args = parser.parse_args()
    llm = LLM(model=args.model, quantization=args.quantization, num_speculative_tokens=0)
    prompts = [llm.tokenizer.encode(p) for p in args.prompts]
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    ]
    gguf = resolve(args.model).path
    theirs = llama_cpp_greedy(args.bin, gguf, prompts, args.tokens, shlex.split(args.server_args))
    print(
        f"{args.model} ({args.quantization}), {args.tokens} greedy tokens, "
        f"llama-server {args.server_args or 'defaults'}; {describe_machine(machine_info())}"
    )
    for text, ids, a, b in zip(args.prompts, prompts, ours, theirs):
        same = first_difference(a, b)
        line = f"{text!r}: {same}/{args.tokens} tokens equal"
        if same < args.tokens:
            line += (
                f"; parted at token {same}: ours {llm.tokenizer.decode([a[same]])!r}, llama.cpp's "
                f"{llm.tokenizer.decode([b[same]])!r}, "
                f"our top-2 logit gap there {top_two_gap(llm, ids + a[:same]):.4f}"
            )
        print(line)
        print(f"    ours:      {llm.tokenizer.decode(a)!r}\n    llama.cpp: {llm.tokenizer.decode(b)!r}")


if __name__ == "__main__":
    main()
