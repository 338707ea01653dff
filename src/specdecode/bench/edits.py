"""Workloads where most of the answer was seen before, for suffix speculation:

- `code-edit`: a function from the installed Python's standard library with an instruction whose answer is
  mostly a copy of it (add type hints, rename a variable, add a docstring), as one chat message.
- `agent-loop`: scripted multi-turn sessions in which each turn asks for the whole file again with one
  change, so every answer after the first repeats most of the one before it (an agent rewriting a file).

Both are deterministic for a seed and need nothing beyond the standard library."""

from __future__ import annotations

import ast
import importlib.util
import random
import textwrap
from pathlib import Path

from ..errors import SpecDecodeError

SOURCE_MODULES = (
    "textwrap",
    "shutil",
    "difflib",
    "csv",
    "configparser",
    "argparse",
    "calendar",
    "fractions",
    "statistics",
    "string",
    "ipaddress",
    "tarfile",
    "zipfile",
    "gettext",
    "heapq",
    "bisect",
)
REPLY = "Reply with the complete function only, in one Python code block."
INSTRUCTIONS = (
    "Add type hints to every parameter and to the return value of this function. " + REPLY,
    "Rename the variable `{old}` to `{new}` everywhere in this function. " + REPLY,
    "Add a docstring to this function that says what it does. " + REPLY,
)

AGENT_TASKS = (
    (
        "Write a Python module with a class `Inventory` that stores items as name -> (count, unit price), with "
        "methods `add(name, count, price)`, `remove(name, count)` and `total_value()`. Reply with the complete "
        "file in one Python code block.",
        [
            "Make `remove` raise a ValueError when more items are removed than are stored.",
            "Add a method `most_valuable(n)` that returns the n names with the highest count x price.",
            "Add type hints to every method.",
            "Add a `__repr__` that lists the items sorted by name.",
        ],
    ),
    (
        "Write a Python module with a class `TodoList` whose tasks have a title, a priority from 1 to 5 and a "
        "done flag, with methods `add(title, priority)`, `complete(title)` and `pending()`. Reply with the "
        "complete file in one Python code block.",
        [
            "Make `pending` return tasks sorted by priority, highest first.",
            "Add a method `to_json()` that returns the tasks as a JSON string.",
            "Add a class method `from_json(text)` that builds a TodoList from that JSON.",
            "Add docstrings to the class and every method.",
        ],
    ),
    (
        "Write a Python module with a function `parse_config(text)` that reads `key = value` lines into a "
        "dict, skipping blank lines and lines starting with '#', and a function `render_config(config)` that "
        "writes such a dict back. Reply with the complete file in one Python code block.",
        [
            "Make `parse_config` convert values that look like integers to int.",
            "Make `parse_config` raise a ValueError naming the line number of a line without '='.",
            "Add support for `[section]` headers: the result maps section names to dicts.",
            "Add type hints to both functions.",
        ],
    ),
)
AGENT_FOLLOW_UP = " Reply with the complete updated file in one Python code block."


CHAT_DATASETS = ("code-edit", "agent-loop")  # chats that end where the reply does; the rest are completion prompts


def describe_dataset(dataset: str, turns: int) -> str:
    """What a benchmark's --dataset plays, for its first line."""
    named = {
        "humaneval": "HumanEval prompts",
        "code-edit": "code-edit chats",
        "agent-loop": f"agent-loop sessions of {turns} turns",
    }
    return named.get(dataset, f"prompts from {dataset}")


def code_edit_prompts(count: int, seed: int = 0, max_lines: int = 40) -> list[list[dict]]:
    """`count` one-message chats, each a standard-library function (8 to max_lines lines) and an edit."""
    functions = _library_functions(8, max_lines)
    if not functions:
        raise SpecDecodeError("found no standard-library source to build code-edit prompts from")
    rng = random.Random(seed)
    picked = rng.sample(functions, min(count, len(functions)))
    chats = []
    for i, (source, names) in enumerate(picked):
        instruction = INSTRUCTIONS[i % len(INSTRUCTIONS)]
        if "{old}" in instruction and not names:
            instruction = INSTRUCTIONS[0]
        old = rng.choice(sorted(names)) if names else ""
        text = instruction.format(old=old, new=f"{old}_value") + f"\n\n```python\n{source}\n```"
        chats.append([{"role": "user", "content": text}])
    return [chats[i % len(chats)] for i in range(count)]


def _library_functions(min_lines: int, max_lines: int) -> list[tuple[str, set[str]]]:
    """(source, local variable names) of top-level functions and methods of SOURCE_MODULES."""
    found = []
    for name in SOURCE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        source = Path(spec.origin).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                text = ast.get_source_segment(source, node, padded=True)
                if text and not any(
                    isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(node) if n is not node
                ):
                    names = {
                        n.id
                        for n in ast.walk(node)
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and len(n.id) > 2
                    }
                    found.append((textwrap.dedent(text), names))
    return sorted(found)


def agent_loop_scripts(count: int, turns: int = 3) -> list[list[str]]:
    """`count` sessions of `turns` user messages: a task, then changes that each ask for the whole file."""
    if not 1 <= turns <= 1 + len(AGENT_TASKS[0][1]):
        raise SpecDecodeError(f"agent-loop sessions have 1 to {1 + len(AGENT_TASKS[0][1])} turns, got {turns}")
    scripts = [[task] + [change + AGENT_FOLLOW_UP for change in changes[: turns - 1]] for task, changes in AGENT_TASKS]
    return [scripts[i % len(scripts)] for i in range(count)]
