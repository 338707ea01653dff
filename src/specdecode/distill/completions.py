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

from tqdm import tqdm

from ..bench.datasets import humaneval_prompts, jsonl_prompts, stdlib_sources
from ..errors import SpecDecodeError
from ..models.loader import LoadedModel
from ..sampling import SamplingParams

PROMPT_SETS = ("stdlib", "humaneval", "jsonl:FILE")
BATCH = 8  # sequences decoded together: plain decoding's throughput on a CPU grows ~4x from 1 to 8


def stdlib_function_prompts(count: int, seed: int = 0, max_lines: int = 60, min_doc: int = 80) -> list[str]:
    """`count` code prefixes: a top-level function of this Python's standard library, from its `def` to
    the end of its docstring (public functions of at most `max_lines` lines whose docstring says what they
    do in `min_doc` characters or more, as a task statement does), chosen at random."""
    prompts = []
    for _, source in stdlib_sources():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in tree.body:
            if (isinstance(node, ast.FunctionDef) and len(ast.get_docstring(node) or "") >= min_doc
                    and not node.name.startswith("_") and node.end_lineno - node.lineno < max_lines
                    and len(node.body) > 1):
                prompts.append("\n".join(lines[node.lineno - 1:node.body[0].end_lineno]) + "\n")
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def completion_prompts(prompt_set: str, count: int) -> list[str]:
    if prompt_set == "stdlib":
        return stdlib_function_prompts(count)
    if prompt_set == "humaneval":
        return humaneval_prompts(count)
    if prompt_set.startswith("jsonl:"):
        return jsonl_prompts(prompt_set[len("jsonl:"):], limit=count)
    raise SpecDecodeError(f"unknown completion prompts {prompt_set!r}; use completions:NAME with NAME one of "
                          f"{', '.join(PROMPT_SETS)}")


def completion_pieces(target: LoadedModel, prompt_set: str, count: int, max_new_tokens: int, chunk: int,
                      path: str, progress: bool = True) -> list[list[int]]:
    """The target's greedy completions of `count` prompts of `prompt_set`, each after its prompt, laid end
    to end and cut into pieces of `chunk` token ids (a completion ends at EOS or after max_new_tokens).
    The stream is generated once and kept at `path`."""
    if os.path.exists(path):
        with open(path) as f:
            stream = json.load(f)
    else:
        stream = _generate_stream(target, completion_prompts(prompt_set, count), max_new_tokens, progress)
        with open(path + ".tmp", "w") as f:
            json.dump(stream, f)
        os.replace(path + ".tmp", path)
    return [stream[i:i + chunk] for i in range(0, len(stream) - chunk + 1, chunk)]


def _generate_stream(target: LoadedModel, prompts: list[str], max_new_tokens: int, progress: bool) -> list[int]:
    from ..engine.llm import LLM

    ids = [target.tokenizer.encode(p) for p in prompts]
    llm = LLM(target=target, num_speculative_tokens=0, max_num_seqs=BATCH, progress=False,
              max_model_len=max(len(i) for i in ids) + max_new_tokens + 1)
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    groups = [llm.engine.add_group(p, params) for p in ids]
    with tqdm(total=len(groups), desc="target completions", unit="prompt", disable=not progress) as bar:
        while llm.engine.has_unfinished():
            llm.engine.step()
            bar.update(sum(g[0].finish_reason is not None for g in groups) - bar.n)
    return [token for p, g in zip(ids, groups) for token in p + list(g[0].output_ids)]
