"""Speed and greedy equality on CUDA at the default pair's shapes (Qwen2.5-Coder 1.5B target, 0.5B draft),
with random weights: for a GPU machine that cannot reach the bundled files. Acceptance means nothing
here (the draft is unrelated to the target); step costs, the forced-accept bound and spec == plain do.

    python tools/cuda_random_weights.py          # SMOKE=1: tiny shapes, runs on a CPU too
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import ByteTokenizer, random_hf_weights  # noqa: E402

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.config import ModelConfig  # noqa: E402
from specdecode.models.loader import LoadedModel  # noqa: E402
from specdecode.models.runtime import build_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 32000  # the byte tokenizer's characters stay below the surrogate range


def random_qwen(hidden: int, intermediate: int, layers: int, heads: int, seed: int) -> LoadedModel:
    cfg = ModelConfig(arch="qwen2", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                      num_layers=layers, num_heads=heads, num_kv_heads=2, rope_theta=1e6, max_position=32768,
                      qkv_bias=True)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model = build_model(cfg, random_hf_weights(cfg, seed, scale=hidden ** -0.5), dtype, DEVICE)
    return LoadedModel(f"random-{hidden}", model, ByteTokenizer(VOCAB), cfg)


def timed(target, draft, prompts, **engine) -> tuple[float, list[list[int]], dict]:
    llm = LLM(target=target, draft=draft if engine.get("num_speculative_tokens") else None, max_model_len=1024,
              max_num_seqs=len(prompts), progress=False, **engine)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (time.perf_counter() - start), [o.outputs[0].token_ids for o in outs], outs[0].spec


def main() -> None:
    small = bool(os.environ.get("SMOKE"))
    target = random_qwen(128, 256, 2, 4, 0) if small else random_qwen(1536, 8960, 28, 12, 0)
    draft = random_qwen(64, 128, 1, 4, 1) if small else random_qwen(896, 4864, 24, 14, 1)
    print(DEVICE, torch.cuda.get_device_name() if DEVICE == "cuda" else "", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (200,), generator=gen).tolist() for _ in range(8)]
    figures = {}
    for batch in (1, 8):
        runs = {"plain": dict(num_speculative_tokens=0),
                "forced-accept k=4, adaptive": dict(num_speculative_tokens=4, forced_accept=True),
                "forced-accept k=4, fixed": dict(num_speculative_tokens=4, forced_accept=True,
                                                 speculation_policy="fixed"),
                "draft k=4, adaptive": dict(num_speculative_tokens=4)}
        outputs = {}
        for name, engine in runs.items():
            tok_s, outputs[name], spec = timed(target, draft, prompts[:batch], **engine)
            figures[f"{name}, batch {batch}"] = round(tok_s, 1)
            print(f"batch {batch}, {name}: {tok_s:.1f} tok/s, {spec['num_spec_steps']} of {spec['num_steps']} "
                  "steps speculated", flush=True)
        same = sum(a == b for a, b in zip(outputs["plain"], outputs["draft k=4, adaptive"]))
        print(f"batch {batch}: speculative greedy == plain for {same}/{batch} sequences", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
