"""Does a draft head predict worse after a long context? Teacher-forced, on the text of one window (the last 1,024
tokens before each END of the standard-library text of tools/long_context.py): the head's top-1 agreement with the
target per drafting round (distill.train.evaluate), the window's features recorded after LENGTH - 1,024 tokens of
context and alone; and for the first END, the same per 2,048 positions of the whole LENGTH.

    python docs/bench/head-context-probe.py HEAD LENGTH END [END ...]
"""

import sys
import time

import torch

from specdecode.bench.datasets import stdlib_sources
from specdecode.distill.data import FeatureSet
from specdecode.distill.train import evaluate, trainable
from specdecode.executor.runner import ModelRunner
from specdecode.models.draft_head import build_head, read_head
from specdecode.models.loader import load_model
from specdecode.proposers.draft_head import head_path

CHUNK, WINDOW, SPAN = 256, 1024, 2048  # SPAN: the positions each line of the first END's profile covers


def record(target, ids: list[int]) -> FeatureSet:
    """The target's features and greedy choices over ids, chunk after chunk in one sequence (positions 0..)."""
    runner = ModelRunner(target.model, 1, len(ids) + CHUNK)
    slot, n = runner.allocate(), len(ids) // CHUNK
    hidden = torch.empty(n, CHUNK, target.model.cfg.hidden_size, dtype=torch.bfloat16)
    choice = torch.empty(n, CHUNK, dtype=torch.int64)
    for i in range(n):
        logits, h = runner.forward([slot], [ids[i * CHUNK : (i + 1) * CHUNK]], logits="all", hidden=True)
        hidden[i], choice[i] = h.view(CHUNK, -1), logits.argmax(-1)
        runner.commit(slot, (i + 1) * CHUNK)
    return FeatureSet(torch.tensor(ids[: n * CHUNK]).view(n, CHUNK), hidden, choice)


def rows(data: FeatureSet, first: int, end: int) -> FeatureSet:
    return FeatureSet(data.tokens[first:end], data.hidden[first:end], data.choice[first:end])


def rounds(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def main() -> None:
    name, length, ends = sys.argv[1], int(sys.argv[2]), [int(e) for e in sys.argv[3:]]
    target = load_model("qwen2.5-coder-1.5b", progress=False)
    head = trainable(build_head(*read_head(head_path(name)), target.model))
    ids = target.tokenizer.encode("\n".join(source for _, source in stdlib_sources()))
    w = WINDOW // CHUNK
    for number, end in enumerate(ends):
        started = time.perf_counter()
        after, alone = record(target, ids[end - length : end]), record(target, ids[end - WINDOW : end])
        same = float((after.choice[-w:] == alone.choice).float().mean())
        late = evaluate(head, rows(after, -w, None), 2)
        print(
            f"window before token {end}: after {length - WINDOW} tokens {rounds(late)}, alone "
            f"{rounds(evaluate(head, alone, 2))}; the target's choices the same at {same:.1%} of its positions "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        for first in range(0, len(after) if number == 0 else 0, SPAN // CHUNK):
            part = rows(after, first, first + SPAN // CHUNK)
            print(f"  positions {first * CHUNK}-{first * CHUNK + SPAN}: {rounds(evaluate(head, part, 2))}", flush=True)


if __name__ == "__main__":
    main()
