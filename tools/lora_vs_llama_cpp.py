"""A LoRA adapter's cost, here and in llama.cpp, in one run: plain decoding of the same prompts with and without the
same adapter file (llama.cpp's GGUF conversion, which both read), by llama-server (its `timings`) and by our engine
(bench latency's rows), then our speculation on the adapted target.

python tools/random_lora.py --out /tmp/lora16
python $LLAMA_CPP/convert_lora_to_gguf.py /tmp/lora16 --base CONFIG_DIR --outtype f16 --outfile /tmp/lora16.gguf
python tools/lora_vs_llama_cpp.py --lora /tmp/lora16.gguf --llama-cpp $(../shared/tools/build-llama-cpp.sh)
"""

from __future__ import annotations

import argparse
import statistics

import httpx
import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import prompts_for
from specdecode.bench.latency import run_config
from specdecode.bench.results import describe_machine, machine_info
from specdecode.bench.server_process import llama_server
from specdecode.models.loader import load_model
from specdecode.models.lora import Adapter
from specdecode.models.sources import resolve


def llama_cpp_tokens_per_s(args, prompts: list[str], lora: str | None) -> float:
    """llama-server's decoding speed (its timings: the prompt's time apart), the mean over the prompts."""
    server = llama_server(args.llama_cpp, resolve(args.model).path, 1, 2048, torch.get_num_threads())
    if lora:
        server.args[-2:-2] = ["--lora", lora]  # before --port N
    with server:
        speeds = []
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{server.base_url}/completion", json=body | {"cache_prompt": False}, timeout=600)
            speeds.append(reply.json()["timings"]["predicted_per_second"])
    return statistics.mean(speeds)


def ours(args, prompts: list[str], adapters: list[Adapter], drafter: str | None = None):
    """Our plain decoding (or speculation with `drafter`) of the prompts: bench latency's row."""
    target = load_model(args.model, progress=False, lora=adapters)
    options = dict(speculative_model=drafter, num_speculative_tokens=3) if drafter else {"num_speculative_tokens": 0}
    llm = LLM(target=target, max_num_seqs=1, **options)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    label = f"{target.model.backend}: {drafter or 'plain'}"
    row, outputs = run_config(llm, prompts, params, 3 if drafter else 0, label, drafter or "none")
    print(f"  {label}: {row.tokens_per_s:.2f} tok/s", flush=True)
    return row, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--lora", required=True, help="the adapter: llama.cpp's GGUF conversion of it")
    parser.add_argument("--llama-cpp", required=True, metavar="BIN_DIR")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    print(describe_machine(machine_info()), flush=True)
    prompts = prompts_for("humaneval", args.num_prompts, args.model)
    llama_plain = llama_cpp_tokens_per_s(args, prompts, None)
    llama_adapted = llama_cpp_tokens_per_s(args, prompts, args.lora)
    plain, _ = ours(args, prompts, [])
    adapted, adapted_ids = ours(args, prompts, [Adapter(args.lora)])
    head, head_ids = ours(args, prompts, [Adapter(args.lora)], "head:qwen2.5-coder-1.5b")
    cost = llama_adapted / llama_plain
    print(f"llama.cpp plain {llama_plain:.2f} tok/s, with the adapter {llama_adapted:.2f} ({cost:.2f}x)")
    rate = adapted.tokens_per_s
    print(
        f"ours plain {plain.tokens_per_s:.2f} tok/s, with the adapter {rate:.2f} ({rate / plain.tokens_per_s:.2f}x; "
        f"{rate / llama_adapted:.2f}x llama.cpp's with it)"
    )
    print(
        f"ours with the adapter, head k=3: {head.tokens_per_s:.2f} tok/s ({head.tokens_per_s / rate:.2f}x our plain, "
        f"{head.tokens_per_s / llama_adapted:.2f}x llama.cpp's), greedy output identical: {head_ids == adapted_ids}"
    )


if __name__ == "__main__":
    main()
