"""What serving adapters by name costs: decoding a batch of HumanEval prompts at once (k = 0), on one engine, by the
target without adapters, with one adapter for every request (--lora), with served adapters all naming the same one,
and with each request naming its own, for each format the adapters are kept in (--lora-dtype), in one run; each
row's decoding rate (the batch's steps once every prompt is prefilled) and its ratio to the unadapted target's, and
whether a served adapter's outputs are the --lora adapter's token for token.

for i in 0 1 2 3; do python tools/random_lora.py --seed $i --out /tmp/lora16-$i; done
python tools/served_lora_cost.py --adapters /tmp/lora16-0 /tmp/lora16-1 /tmp/lora16-2 /tmp/lora16-3 \
    --lora-dtype auto bfloat16
"""

from __future__ import annotations

import argparse
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import prompts_for
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import LORA_DTYPES
from specdecode.models.loader import load_model
from specdecode.models.lora import Adapter


def timed(llm: LLM, prompts: list[str], params: SamplingParams, names: list[str], repeats: int):
    """The best decoding rate over the repeats (after one warm-up): tokens/s of the batch's steps once every prompt is
    prefilled; and the outputs' token ids."""
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), adapter=names[:1])
    engine, best = llm.engine, 0.0
    for _ in range(repeats):
        seqs = [engine.add_group(llm.tokenizer.encode(p), params, adapter=n)[0] for p, n in zip(prompts, names)]
        while any(seq.metrics.num_output_tokens == 0 for seq in seqs):
            engine.step()
        started, before = time.perf_counter(), sum(seq.metrics.num_output_tokens for seq in seqs)
        while engine.has_unfinished():
            engine.step()
        after = sum(seq.metrics.num_output_tokens for seq in seqs)
        best = max(best, (after - before) / (time.perf_counter() - started))
    return best, [seq.output_ids for seq in seqs]


def adapted_rows(served: dict[str, Adapter], dtypes: list[str], batch: int) -> list[tuple[str, dict, list[str]]]:
    """(label, load_model's options, each request's adapter) of the adapted rows, a set per format."""
    half = ["", "a0"] * (batch // 2) + [""] * (batch % 2)
    rows = []
    for dtype in dtypes:
        each, common = {"served_lora": served, "lora_dtype": dtype}, {"lora": [served["a0"]], "lora_dtype": dtype}
        rows += [
            (f"--lora a0, every request [{dtype}]", common, [""] * batch),
            (f"served, every request a0 [{dtype}]", each, ["a0"] * batch),
            (f"served, each its own [{dtype}]", each, list(served)),
            (f"served, half none, half a0 [{dtype}]", each, half),
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--adapters", nargs="+", required=True, help="one per request of the batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--head", help="also speculate with this drafter on the last row's engine (head:NAME)")
    parser.add_argument("--lora-dtype", nargs="+", default=["auto"], choices=LORA_DTYPES, help="one set of rows each")
    args = parser.parse_args()
    print(describe_machine(machine_info()), flush=True)
    batch = len(args.adapters)
    prompts = prompts_for("humaneval", batch, args.model)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    served = {f"a{i}": Adapter(path) for i, path in enumerate(args.adapters)}
    results = {}
    for label, options, names in [("no adapter", {}, [""] * batch)] + adapted_rows(served, args.lora_dtype, batch):
        target = load_model(args.model, progress=False, **options)
        llm = LLM(target=target, num_speculative_tokens=0, max_num_seqs=batch)
        results[label] = timed(llm, prompts, params, names, args.repeats)
        rate = results[label][0]
        print(f"  {label:40s} {rate:7.2f} tok/s  {rate / results['no adapter'][0]:.2f}x", flush=True)
    for dtype in args.lora_dtype:
        same = results[f"served, every request a0 [{dtype}]"][1] == results[f"--lora a0, every request [{dtype}]"][1]
        print(f"batch {batch}, {args.max_tokens} tokens each; served a0's outputs are --lora a0's [{dtype}]: {same}")
    if args.head:
        llm = LLM(target=target, speculative_model=args.head, num_speculative_tokens=3, max_num_seqs=batch)
        rate, ids = timed(llm, prompts, params, list(served), args.repeats)
        plain = results[f"served, each its own [{args.lora_dtype[-1]}]"]
        print(
            f"served, each its own, {args.head} k=3 (adaptive): {rate:.2f} tok/s, {rate / plain[0]:.2f}x their plain "
            f"decoding; outputs identical: {ids == plain[1]}"
        )


if __name__ == "__main__":
    main()
