"""Our float32 log-probabilities against llama.cpp's own on a GGUF file: llama-server continues a prompt greedily
and reports its top log-probabilities at every token (n_probs); this engine computes the same sequence in one
forward, and the largest difference over llama.cpp's top ones is the measure. Unlike greedy agreement, this
compares every position, so a position-dependent feature (an attention temperature past a floor, a window, a
scaled RoPE past its original context) is checked where it acts.

    python tools/logprobs_vs_llama_cpp.py FILE.gguf --bin BIN [--prompt-tokens 30] [--tokens 80]

The prompt is random token ids after BOS (the comparison needs no text). llama-server runs with a float32 KV
cache and flash attention off, so that both sides sum in float32.
"""

from __future__ import annotations

import argparse

import httpx
import torch

from specdecode.bench.results import describe_machine, machine_info
from specdecode.bench.server_process import llama_server
from specdecode.executor.runner import ModelRunner
from specdecode.models.gguf_loader import load_gguf
from specdecode.models.runtime import build_model

FLOAT32_SERVER = ("-fa", "off", "-ctk", "f32", "-ctv", "f32")


def llama_cpp_top_logprobs(bin_dir: str, gguf: str, prompt: list[int], tokens: int, top: int):
    """llama.cpp's greedy continuation and, at each of its tokens, its top log-probabilities {id: logprob}."""
    fields = dict(prompt=prompt, n_predict=tokens, temperature=0, top_k=1, n_probs=top, ignore_eos=True)
    with llama_server(bin_dir, gguf, slots=1, context=1024, threads=2, extra=FLOAT32_SERVER) as server:
        fields.update(cache_prompt=False, return_tokens=True, post_sampling_probs=False)
        out = httpx.post(f"{server.base_url}/completion", json=fields, timeout=600).json()
    tops = [{t["id"]: t["logprob"] for t in step["top_logprobs"]} for step in out["completion_probabilities"]]
    return out["tokens"], tops


def our_logprobs(model, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of the model's logits at every position of ids."""
    runner = ModelRunner(model, 1, len(ids) + 1)
    return torch.log_softmax(runner.forward([runner.allocate()], [ids], "all").double(), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--bin", required=True, help="the folder build-llama-cpp.sh printed")
    parser.add_argument("--prompt-tokens", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--bos", type=int, default=1)
    args = parser.parse_args()
    cfg, tensors = load_gguf(args.gguf, progress=False)
    ids = torch.randint(args.bos + 2, cfg.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    prompt = [args.bos, *ids.tolist()]
    tokens, tops = llama_cpp_top_logprobs(args.bin, args.gguf, prompt, args.tokens, args.top)
    model = build_model(cfg, tensors, torch.float32, "cpu")  # float32, as llama-server computes
    ours = our_logprobs(model, prompt + tokens[:-1])[len(prompt) - 1 :]
    print(f"{args.gguf}: {len(prompt)} prompt tokens, {len(tokens)} by llama.cpp; {describe_machine(machine_info())}")
    worst = 0.0
    for i, top in enumerate(tops):
        gaps = {token: abs(ours[i, token].item() - logprob) for token, logprob in top.items()}
        worst = max(worst, *gaps.values())
        if i % 10 == 0 or max(gaps.values()) > 1e-3:
            theirs = ", ".join(f"{t}: {lp:.4f}" for t, lp in top.items())
            mine = ", ".join(f"{ours[i, t].item():.4f}" for t in top)
            print(f"  position {len(prompt) + i}: llama.cpp {{{theirs}}}, ours {mine}")
    print(f"largest |log-probability difference| over llama.cpp's top {args.top}, every position: {worst:.2e}")


if __name__ == "__main__":
    main()
