"""The target's own completions as training text. A head drafts continuations of what the target is
writing, so it learns best from text the target wrote: code prefixes (a function's signature and
docstring, as HumanEval poses a task) completed greedily by the target on the backend it serves with.

The completions are generated once per target, prompt set and length, and kept beside the recorded
features, so a resumed recording reads the same text (batched greedy decoding need not repeat itself
bit for bit)."""

from __future__ import annotations

import ast
import json
import os
import random
import textwrap
import time

import torch
from tqdm import tqdm

from ..bench.datasets import humaneval_prompts, jsonl_prompts, python_sample, python_sources, stdlib_sources
from ..errors import SpecDecodeError
from ..kv_cache import KVCache
from ..models.loader import LoadedModel
from ..models.runtime import ForwardBatch
from ..sampling import SamplingParams

PROMPT_SETS = ("stdlib", "python[:N]", "humaneval", "jsonl:FILE")
# prompts decoded together. A GPU step is bound by its launches, so hundreds of sequences cost about what
# one does; on a CPU plain decoding's throughput grows ~4x from 1 to 8 sequences and little after
BATCH = {"cuda": 256, "cpu": 8}
PADDED = {"cuda"}  # devices that decode completions in padded calls; elsewhere the engine's packed steps
MAX_PROMPT_TOKENS = 512  # longer prompts are left out: one would widen its whole batch's padded calls
CHARS_PER_PROMPT = 10_000  # of `python` source read per prompt wanted: ~8 KB hold a documented function


def documented_functions(source: str, max_lines: int = 60, min_doc: int = 80) -> list[str]:
    """Code prefixes from one module: a function (top-level, or a method of a top-level class, dedented)
    from its `def` to the end of its docstring, for public functions of at most `max_lines` lines whose
    docstring says what they do in `min_doc` characters or more, as a task statement does."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    nodes = [n for top in tree.body for n in ([top] if not isinstance(top, ast.ClassDef) else top.body)]
    return [
        textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])) + "\n"
        for node in nodes
        if (
            isinstance(node, ast.FunctionDef)
            and len(ast.get_docstring(node) or "") >= min_doc
            and not node.name.startswith("_")
            and node.end_lineno - node.lineno < max_lines
            and len(node.body) > 1
        )
    ]


def function_prompts(sources: list[str], count: int, seed: int = 0) -> list[str]:
    """`count` documented-function prefixes (see documented_functions) of the sources, chosen at random."""
    prompts = [p for source in sources for p in documented_functions(source)]
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def stdlib_function_prompts(count: int, seed: int = 0) -> list[str]:
    """Documented top-level functions and methods of this Python's own top-level modules."""
    return function_prompts([text for _, text in stdlib_sources()], count, seed)


def completion_prompts(prompt_set: str, count: int) -> list[str]:
    if prompt_set == "stdlib":
        return stdlib_function_prompts(count)
    if prompt_set.split(":")[0] == "python":  # the standard library's and installed packages' source
        return function_prompts(python_sources(CHARS_PER_PROMPT * count, sample=python_sample(prompt_set)), count)
    if prompt_set == "humaneval":
        return humaneval_prompts(count)
    if prompt_set.startswith("jsonl:"):
        return jsonl_prompts(prompt_set[len("jsonl:") :], limit=count)
    raise SpecDecodeError(
        f"unknown completion prompts {prompt_set!r}; use completions:NAME with NAME one of {', '.join(PROMPT_SETS)}"
    )


def completion_pieces(
    target: LoadedModel,
    prompt_set: str,
    count: int,
    max_new_tokens: int,
    chunk: int,
    path: str,
    progress: bool = True,
    deadline: float | None = None,
) -> list[list[int]]:
    """The target's greedy completions of `count` prompts of `prompt_set`, each after its prompt, laid end
    to end and cut into pieces of `chunk` token ids (a completion ends at EOS or after max_new_tokens).
    The stream is generated once and kept at `path`; past `deadline` (a time.time()) no further batch of
    prompts starts, and what was completed is kept."""
    if os.path.exists(path):
        with open(path) as f:
            stream = json.load(f)
    else:
        stream = _generate_stream(target, completion_prompts(prompt_set, count), max_new_tokens, progress, deadline)
        with open(path + ".tmp", "w") as f:
            json.dump(stream, f)
        os.replace(path + ".tmp", path)
    return [stream[i : i + chunk] for i in range(0, len(stream) - chunk + 1, chunk)]


def _generate_stream(
    target: LoadedModel, prompts: list[str], max_new_tokens: int, progress: bool, deadline: float | None = None
) -> list[int]:
    ids = [i for i in (target.tokenizer.encode(p) for p in prompts) if len(i) <= MAX_PROMPT_TOKENS]
    ids.sort(key=len)  # batches of similar lengths pad little
    generate = _padded_batches if target.model.device.type in PADDED else _engine_stream
    with tqdm(total=len(ids), desc="target completions", unit="prompt", disable=not progress) as bar:
        completions = generate(target, ids, max_new_tokens, deadline, bar)
    stream = [token for prompt, completion in zip(ids, completions) for token in prompt + completion]
    if progress:  # the bar's last line may be lost among a log's lines: say what the data holds
        tqdm.write(
            f"target completions: {len(completions):,} of {len(ids):,} prompts, {len(stream):,} tokens "
            f"with their prompts, in {bar.format_dict['elapsed']:.0f} s"
        )
    return stream


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() > deadline


def _padded_batches(target: LoadedModel, ids: list[list[int]], max_new_tokens: int, deadline, bar) -> list[list[int]]:
    """The first prompts' completions, BATCH of them at a time in padded calls, until the deadline."""
    batch, completions = BATCH.get(target.model.device.type, BATCH["cpu"]), []
    for first in range(0, len(ids), batch):
        if _past(deadline):
            break
        group = ids[first : first + batch]
        completions += greedy_completions(target, group, max_new_tokens)
        bar.update(len(group))
    return completions


def _engine_stream(target: LoadedModel, ids: list[list[int]], max_new_tokens: int, deadline, bar) -> list[list[int]]:
    """The first prompts' completions through the engine's packed steps (on a CPU its attention kernel makes
    them about twice as fast as padded calls, docs/decisions.md#the-targets-completions-as-training-data),
    BATCH["cpu"] in flight: the next prompt joins as one finishes, until the deadline."""
    from ..engine.llm import LLM

    llm = LLM(
        target=target,
        num_speculative_tokens=0,
        max_num_seqs=BATCH["cpu"],
        progress=False,
        max_model_len=max(map(len, ids), default=0) + max_new_tokens + 1,
    )
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    seqs = []
    while True:
        while len(seqs) < len(ids) and sum(not s.finished for s in seqs) < BATCH["cpu"] and not _past(deadline):
            seqs += llm.engine.add_group(ids[len(seqs)], params)
        if not llm.engine.has_unfinished():
            return [list(s.output_ids) for s in seqs]
        llm.engine.step()
        bar.update(sum(s.finished for s in seqs) - bar.n)


@torch.inference_mode()
def greedy_completions(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation (through its EOS, or max_new_tokens), all decoded together in
    padded calls: one masked attention call per layer, where the engine's packed steps attend token by
    token (exact per token, but on a GPU a launch each: 256 prompts would take 7,168 a step). The rows
    beyond a shorter prompt stay unwritten until its own tokens fill them, and the mask keeps them out of
    sight until then."""
    model, eos = target.model, target.tokenizer.eos_token_ids
    n, slots = len(prompts), list(range(len(prompts)))
    max_len = max(map(len, prompts)) + max_new_tokens
    cache = KVCache(model.cfg, n, max_len, model.kv_dtype, model.device)
    for slot in slots:
        cache.reserve(slot, max_len)
    tokens = torch.nn.utils.rnn.pad_sequence([torch.tensor(p) for p in prompts], batch_first=True)
    starts, new = [0] * n, [len(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    running = set(slots)
    for _ in range(max_new_tokens):
        batch = ForwardBatch.build(slots, starts, new, max_len, model.device, rowwise_width=0)
        chosen = model(tokens.to(model.device), batch, cache).argmax(-1)
        for i, token in enumerate(chosen.tolist()):
            if i in running:
                outputs[i].append(token)
                if token in eos:
                    running.discard(i)
        if not running:
            break
        starts, new, tokens = [s + k for s, k in zip(starts, new)], [1] * n, chosen[:, None]
    return outputs
