"""Tokens a greedy step would take with the shipped draft head drafting a tree of tokens rather than a chain.

For each HumanEval prompt: the target's greedy continuation (the live path, through the engine), the target's features
along it, and the head's drafting rounds along that path at every position at once (DraftHead.unrolled: round s at row
q as drafting computes it, the training-time test's rounds); then the rank of the target's token among the head's
at each depth of a step that starts at each position. A tree of drafts, as the rank paths it holds (prefix-closed),
accepts the longest prefix of a step's true rank path that it holds; decoding is replayed step by step, each step
starting after the tokens the last one took, as live decoding does. Each size's tree is made of the rank paths most
often on the true path in half of the prompts (greedy: a path's frequency never exceeds its parent's) and scored on
the other half. The chain with the engine's confidence stop is replayed too, beside the engine's own live figures.

    python tools/tree_acceptance.py [--num-prompts 20] [--max-tokens 128] [--depth 6] [--out results/tree.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import humaneval_prompts
from specdecode.bench.results import describe_machine, machine_info
from specdecode.config import DEFAULT_HEAD, DEFAULT_TARGET
from specdecode.executor.runner import ModelRunner

RANKS = 8  # ranks past this are not drafted by any tree considered
SIZES = (1, 3, 7, 15, 31, 63)  # draft tokens a step: with the bonus token's, a power of two rows (a GPU's buckets)


def live_paths(llm: LLM, prompts: list[str], max_tokens: int):
    """Each prompt's token ids and the target's greedy continuation (speculative greedy is the target's own), with
    the engine's acceptance per draft position."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    totals = llm.engine.totals
    live = {"acceptance_per_position": totals.acceptance_per_position, "tokens_per_step": totals.mean_accepted_length}
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs], live


def step_ranks(llm: LLM, prompt: list[int], output: list[int], depth: int):
    """For each start row p (the target's features known up to p, token p + 1 known): the rank of the true token p + 1
    + d among the head's round d - 1 at row p + d - 1, and the head's probability of its own top draft there
    ([T - 1, depth] each; rows past the sequence: a rank of RANKS)."""
    target, head = llm.engine.runner.model, llm.engine.proposer.model
    seq = prompt + output
    runner = ModelRunner(target, 1, len(seq) + 8)
    slot = runner.allocate()
    with torch.inference_mode():
        _, hidden = runner.forward([slot], [seq], logits="last", hidden="all")
    to_draft = torch.full((target.cfg.vocab_size,), -1, dtype=torch.long)
    to_draft[head.vocab_ids.long()] = torch.arange(len(head.vocab_ids))
    tokens = torch.tensor(seq[1:])[None]
    width = len(seq) - 1
    ranks = torch.full((width, depth), RANKS, dtype=torch.long)
    confidence = torch.zeros(width, depth)
    with torch.no_grad():
        rounds = head.unrolled(tokens, hidden[:-1].float()[None], depth)
    for s, (logits, _) in enumerate(rounds):
        logits = logits.float()
        rows = torch.arange(s, width)  # round s's row q serves the step starting at p = q - s
        q = rows[rows + 2 < len(seq)]
        truth = to_draft[torch.tensor(seq)[q + 2]]
        mine = logits[q].gather(1, truth.clamp(min=0)[:, None])[:, 0]
        rank = (logits[q] > mine[:, None]).sum(1)
        rank[truth < 0] = RANKS  # outside the draft vocabulary: never drafted
        ranks[q - s, s] = rank.clamp(max=RANKS)
        confidence[q - s, s] = torch.softmax(logits[q], -1).max(1).values
    return ranks, confidence, len(prompt)


def replay(ranks, confidence, prompt_len: int, accept) -> tuple[int, int, int]:
    """Live decoding replayed: (steps, tokens emitted, steps whose first draft was the target's)."""
    p, steps, tokens, first = prompt_len - 1, 0, 0, 0
    while p + 1 < len(ranks):  # the token after the step's bonus token is in the sequence
        taken = accept(ranks[p].tolist(), confidence[p].tolist())
        steps, tokens, first = steps + 1, tokens + taken + 1, first + (ranks[p, 0] == 0)
        p += taken + 1
    return steps, tokens, int(first)


def replayed(per_prompt, accept) -> tuple[int, int, int]:
    """replay's counts summed over prompts (each its ranks, confidences and prompt length)."""
    totals = [replay(ranks, confidence, n, accept) for ranks, confidence, n in per_prompt]
    return tuple(sum(t[i] for t in totals) for i in range(3))


def tree_of(counts: Counter, size: int) -> set[tuple[int, ...]]:
    """The `size` rank paths most often on the true path, each with its parent."""
    tree: set[tuple[int, ...]] = set()
    while len(tree) < size:
        frontier = [path for path in counts if path not in tree and (len(path) == 1 or path[:-1] in tree)]
        if not frontier:
            break
        tree.add(max(frontier, key=lambda path: (counts[path], -len(path), [-r for r in path])))
    return tree


def in_tree(tree: set[tuple[int, ...]]):
    def accept(ranks: list[int], _) -> int:
        taken = 0
        while taken < len(ranks) and tuple(ranks[: taken + 1]) in tree:
            taken += 1
        return taken

    return accept


def chain(k: int, threshold: float):
    """The engine's chain: the head's top draft at each depth up to k, stopping after a draft it gives < threshold."""

    def accept(ranks: list[int], confidence: list[float]) -> int:
        taken = 0
        while taken < min(k, len(ranks)) and ranks[taken] == 0:
            taken += 1
            if confidence[taken - 1] < threshold:
                break
        return taken

    return accept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.perf_counter()
    llm = LLM(model=DEFAULT_TARGET, speculative_model=DEFAULT_HEAD, num_speculative_tokens=4, progress=False,
              speculation_policy="fixed")  # fmt: skip
    paths, live = live_paths(llm, humaneval_prompts(args.num_prompts), args.max_tokens)
    print(describe_machine(machine_info()))
    stop = llm.engine.proposer.confidence_threshold
    print(f"live, the engine (the head, k = 4, confidence stop {stop}): acceptance per position "
          f"{' '.join(f'{a:.3f}' for a in live['acceptance_per_position'])}, mean accepted length "
          f"{live['tokens_per_step']:.3f}")  # fmt: skip
    per_prompt = [step_ranks(llm, prompt, output, args.depth) for prompt, output in paths]
    fit, scored = per_prompt[::2], per_prompt[1::2]
    counts: Counter = Counter()
    for ranks, _, prompt_len in fit:
        for row in ranks[prompt_len - 1 :].tolist():
            for d in range(len(row)):
                if row[d] >= RANKS:
                    break
                counts[tuple(row[: d + 1])] += 1
    trees = {size: tree_of(counts, size) for size in SIZES}
    ways = {  # name: (how a step takes drafts, drafts a step)
        "chain k=4, stop 0.8 (the CPU's)": (chain(4, 0.8), 4),
        "chain k=4, no stop": (chain(4, 0.0), 4),
        "chain k=6, no stop": (chain(6, 0.0), 6),
        **{f"tree of {size}": (in_tree(tree), size) for size, tree in trees.items()},
    }
    results = {"live_acceptance": live, "rows": {}}
    steps, tokens, _ = replayed(per_prompt, chain(4, stop))
    results["replayed_as_live"] = tokens / steps
    print(f"the engine's chain replayed on the same {len(per_prompt)} prompts: {tokens / steps:.3f} tokens a step")
    print(f"replayed on {len(scored)} prompts (trees made on the other {len(fit)}):")
    for name, (accept, drafts) in ways.items():
        steps, tokens, first = replayed(scored, accept)
        results["rows"][name] = {"tokens_per_step": tokens / steps, "first_accepted": first / steps, "drafts": drafts}
        print(f"  {name:36s}: {tokens / steps:.3f} tokens a step ({steps} steps), the head's top draft the "
              f"target's {first / steps:.3f}, verify rows {drafts + 1}")  # fmt: skip
    shown = {size: sorted(trees[size], key=lambda p: (len(p), p)) for size in (7, 15)}
    for size, tree in shown.items():
        print(f"  the tree of {size}: {' '.join(''.join(map(str, p)) for p in tree)}")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**results, "trees": {k: [list(p) for p in v] for k, v in shown.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
