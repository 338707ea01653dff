"""Training data for a draft head: text the target reads, and what it computes on it.

For every chunk of text the target (on the backend it will serve with) records its final hidden states
and its own next-token choice at every position: the head learns the target as it runs, not the
checkpoint's float model. Collected features are cached per target and recipe, so a second run (or a
resumed one) skips the target's forwards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..bench.datasets import humaneval_prompts, jsonl_prompts, poem_lines, python_sample, python_sources, stdlib_sources
from ..errors import SpecDecodeError
from ..executor.runner import ModelRunner
from ..models.loader import LoadedModel
from ..models.sources import cache_root
from ..proposers.vocabulary import in_row_groups
from .completions import completion_pieces
from .recipe import Recipe

SOURCES = ("stdlib", "python[:N]", "sonnets", "humaneval", "jsonl:FILE", "completions:NAME")
CHARS_PER_TOKEN = 5  # read for `python`: code runs ~4.3 characters a token, and each file's tail is cut


@dataclass
class FeatureSet:
    tokens: torch.Tensor  # [chunks, T] token ids
    hidden: torch.Tensor  # [chunks, T, hidden] the target's final hidden states, bf16 (all on the CPU)
    choice: torch.Tensor  # [chunks, T] the target's greedy next token at each position
    planned: int | None = None  # the chunks the recipe asked for, where a deadline cut the recording short

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def split(self, held_out: float) -> tuple["FeatureSet", "FeatureSet"]:
        n = max(1, int(len(self) * held_out))
        return (
            FeatureSet(self.tokens[:-n], self.hidden[:-n], self.choice[:-n]),
            FeatureSet(self.tokens[-n:], self.hidden[-n:], self.choice[-n:]),
        )


def source_texts(source: str, max_tokens: int) -> list[str]:
    """Training texts by source name (see SOURCES); `python` reads about what max_tokens needs."""
    if source == "stdlib":
        return [text for _, text in stdlib_sources()]
    if source.split(":")[0] == "python":
        return python_sources(CHARS_PER_TOKEN * max_tokens, sample=python_sample(source))
    if source == "sonnets":
        lines = poem_lines()
        return ["\n".join(lines[i : i + 14]) for i in range(0, len(lines), 14)]
    if source == "humaneval":
        return humaneval_prompts()
    if source.startswith("jsonl:"):
        return jsonl_prompts(source[len("jsonl:") :], field="text")
    raise SpecDecodeError(f"unknown distill data source {source!r}; use one of {', '.join(SOURCES)}")


def token_chunks(texts: list[str | list[int]], tokenizer, chunk: int, max_tokens: int) -> list[list[int]]:
    """Texts (or token ids) tokenized and cut into chunks of `chunk` tokens, interleaved across texts (so a
    small budget still sees many files), up to `max_tokens` in all."""
    per_text = [tokenizer.encode(t) if isinstance(t, str) else t for t in texts]
    pieces = [[ids[i : i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)] for ids in per_text]
    out: list[list[int]] = []
    for round_ in range(max((len(p) for p in pieces), default=0)):
        for p in pieces:
            if round_ < len(p) and len(out) * chunk < max_tokens:
                out.append(p[round_])
    return out


def collect_features(
    target: LoadedModel,
    sources: list[str],
    chunk: int,
    max_tokens: int,
    progress: bool = True,
    completions: tuple[int, int] = (Recipe.completions, Recipe.completion_tokens),
    deadline: float | None = None,
    generation_deadline: float | None = None,
) -> FeatureSet:
    """The target's features on the sources' text, read from the cache when this recipe ran before.
    completions: prompts completed and new tokens per completion, for each `completions:NAME` source,
    whose generation starts no batch of prompts past generation_deadline.
    deadline (a time.time()): the recording stops at the first shard past it and returns the chunks so
    far, its shards kept, so that a later run (with more time) carries on from them."""
    generated = [s for s in sources if s.startswith("completions:")]
    path = _cache_path(target, sources, chunk, max_tokens, *([list(completions)] if generated else []))
    if os.path.exists(path):
        return FeatureSet(**torch.load(path, map_location="cpu"))
    texts = []
    for source in sources:
        if source in generated:  # one piece of token ids per chunk: each counts as a text of its own
            prompt_set = source[len("completions:") :]
            kept = _cache_path(target, prompt_set, *completions)[:-3] + ".completions.json"
            texts += completion_pieces(target, prompt_set, *completions, chunk, kept, progress, generation_deadline)
        else:
            texts += source_texts(source, max_tokens)
    chunks = token_chunks(texts, target.tokenizer, chunk, max_tokens)
    if not chunks:
        raise SpecDecodeError(f"the data sources {sources} hold no chunk of {chunk} tokens")
    hidden, choice = _record(target, chunks, path + ".parts", progress, deadline)
    data = FeatureSet(torch.tensor(chunks[: len(hidden)]), hidden, choice)
    if len(data) < len(chunks):
        data.planned = len(chunks)
        return data
    torch.save(vars(data), path + ".tmp")
    os.replace(path + ".tmp", path)
    shutil.rmtree(path + ".parts")
    return data


def _cache_path(target: LoadedModel, *recipe) -> str:
    """Where what the target computed for this recipe is kept (per target, backend and recipe)."""
    from ..models.draft_head import target_fingerprint

    adapters = getattr(target.model, "adapters", [])  # LoRA's: the same backend and layers, other features
    key = json.dumps([target_fingerprint(target.model), target.model.backend, *adapters, *recipe])
    folder = os.path.join(cache_root(), "distill")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:16] + ".pt")


# chunks per target forward while recording: a GPU runs one 256-token chunk in about the time of a few
# launches per layer, so it records several at once; a CPU is busy with one
RECORD_BATCH = {"cuda": 16}
SHARD = 8  # chunks per shard file at least (a whole number of forwards)


def _record(
    target: LoadedModel, chunks: list[list[int]], parts: str, progress: bool, deadline: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden states [chunks, T, hidden] (bf16) and greedy choices [chunks, T], written into
    tensors allocated once: a tensor kept per chunk between the forward's large temporaries fragments a
    heap that the runner asks never to be trimmed (docs/decisions.md#recording-shards-and-preallocated-tensors).
    Every shard of chunks goes to a file of its own in `parts`, from which an interrupted run resumes
    (appending shards keeps saving linear in the data)."""
    batch = RECORD_BATCH.get(target.model.device.type, 1)
    shard = -(-SHARD // batch) * batch
    runner = ModelRunner(target.model, batch, len(chunks[0]))
    hidden = torch.empty(len(chunks), len(chunks[0]), target.model.cfg.hidden_size, dtype=torch.bfloat16)
    choice = torch.empty(len(chunks), len(chunks[0]), dtype=torch.int64)
    done = _read_shards(parts, hidden, choice)
    slots = [runner.allocate() for _ in range(batch)]
    with tqdm(desc="target features", unit="chunk", initial=done, total=len(chunks), disable=not progress) as bar:
        for first in range(done, len(chunks), shard):
            end = min(first + shard, len(chunks))
            for i in range(first, end, batch):
                rows = slice(i, min(i + batch, end))
                _record_chunks(runner, slots, chunks[rows], hidden[rows], choice[rows])
                bar.update(rows.stop - rows.start)
            os.makedirs(parts, exist_ok=True)
            name = os.path.join(parts, f"{first:06d}.pt")
            # clones: saving a slice would save the whole recording's storage
            torch.save({"hidden": hidden[first:end].clone(), "choice": choice[first:end].clone()}, name + ".tmp")
            os.replace(name + ".tmp", name)
            if deadline is not None and time.time() > deadline:
                return hidden[:end], choice[:end]
    return hidden, choice


def _record_chunks(
    runner: ModelRunner, slots: list[int], chunks: list[list[int]], hidden: torch.Tensor, choice: torch.Tensor
) -> None:
    """Chunks' features and choices into their rows of `hidden` and `choice`, in one forward (the
    full-vocabulary logits die here)."""
    slots = slots[: len(chunks)]
    for slot in slots:
        runner.rollback(slot, 0)
    logits, h = runner.forward(slots, chunks, logits="all", hidden=True)
    # kept in host memory wherever the target runs: the recording outgrows a GPU's spare memory, and the
    # cache file then loads on any machine
    hidden.copy_(h.view(hidden.shape))
    choice.copy_(logits.argmax(-1).view(choice.shape))


def _read_shards(parts: str, hidden: torch.Tensor, choice: torch.Tensor) -> int:
    """What an interrupted recording saved, into the first rows in chunk order (shard files are named by
    their first chunk); returns how many chunks that was."""
    done = 0
    for name in sorted(os.listdir(parts)) if os.path.isdir(parts) else []:
        if name.endswith(".pt") and int(name[:-3]) == done:
            shard = torch.load(os.path.join(parts, name), map_location="cpu")
            rows = torch.stack(list(shard["hidden"]))  # stacked, or a list per chunk (older recordings)
            hidden[done : done + len(rows)], choice[done : done + len(rows)] = rows, torch.stack(list(shard["choice"]))
            done += len(rows)
    return done


def draft_vocabulary(data: FeatureSet, size: int, special_ids, vocab_size: int) -> torch.Tensor:
    """The `size` tokens the target chose most often on the data (the lowest ids after them where it chose
    fewer), plus the special tokens, in whole 16-row groups."""
    counts = torch.bincount(data.choice.flatten(), minlength=vocab_size)
    # ties (count 0 included) go to the lowest id: byte-pair ranks put frequent merges first
    order = torch.sort(-counts, stable=True).indices
    return in_row_groups(order[:size], special_ids, vocab_size)
