"""Experiment, not a tool: does the shipped head accept less at long contexts because its one attention layer reads
more keys than it was trained on (256-token chunks)? One long prompt prefilled once, then decoded at a fixed k with
the head's attention limited to its last W keys, each W in turn (the target and its output are untouched).

    python docs/bench/head-window-probe.py LENGTH END W1,W2,... [K]   (W: a number of keys, or none)
"""

import sys
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import stdlib_sources
from specdecode.engine.policy import FixedPolicy

length, end = int(sys.argv[1]), int(sys.argv[2])
windows = [None if w == "none" else int(w) for w in sys.argv[3].split(",")]
k = int(sys.argv[4]) if len(sys.argv) > 4 else 3
llm = LLM(model="qwen2.5-coder-1.5b", speculative_model="head:qwen2.5-coder-1.5b", progress=False)
ids = llm.tokenizer.encode("\n".join(source for _, source in stdlib_sources()))[end - length : end]
attention = llm.engine.proposer.model.layers[0].self_attn
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
started = time.perf_counter()
first = llm.generate([ids], params)[0]
print(f"prefill+decode {time.perf_counter() - started:.1f} s", flush=True)
llm.engine.policy = FixedPolicy(k)
for _ in range(2):
    for window in windows:
        attention.window = window
        out = llm.generate([ids], params)[0]
        spec = out.spec
        assert out.outputs[0].token_ids == first.outputs[0].token_ids
        print(
            f"window {window}: tau {spec['mean_accepted_length']:.2f} drafts/step "
            f"{spec['num_draft_tokens'] / max(spec['num_spec_steps'], 1):.2f} accepted "
            f"{spec['num_accepted_tokens']}/{spec['num_draft_tokens']} tok/s {1 / spec['tpot_s']:.2f}",
            flush=True,
        )
