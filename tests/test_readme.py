"""The README shows only what exists: every `specdecode` subcommand and flag in it is accepted by the CLI's
own parser, every `make` target is in the Makefile, its Python examples compile and what they import from
specdecode (and the keyword arguments they pass to it) exists, its relative links reach files and headings
that exist, and it stays short. docs/usage.md, the full reference, gets the same checks on its flags and
examples. Each checker is also run on a made-up name, which it must report. No model is loaded."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from specdecode.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
MAX_README_LINES = 250

FENCE = re.compile(r"^[ \t]*```([\w+-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
# a command at the start of a line, after optional VAR=value assignments, by name or from a bin/ folder
INVOCATION = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\S*bin/)?(specdecode|make)(?:\s+(.*))?$")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text"}


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(markdown)]


def prose(markdown: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", markdown)


def strip_comment(line: str) -> str:
    """The line up to a shell comment: '#' at the start or after whitespace, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def logical_lines(block: str) -> list[str]:
    """Backslash continuations joined; an indented line starting with '[' (a synopsis going on) joined to
    the line before; comments dropped."""
    lines: list[str] = []
    for raw in block.replace("\\\n", " ").splitlines():
        if lines and re.match(r"\s+\[", raw):
            lines[-1] += " " + raw.strip()
        else:
            lines.append(raw)
    return [strip_comment(line).rstrip() for line in lines]


def invocations(markdown: str, inline: bool = True) -> list[tuple[str, str, bool]]:
    """(program, arguments, fenced) of every `specdecode ...` and `make ...` in shell code blocks, and in
    inline code spans when asked."""
    found = []
    for lang, body in code_blocks(markdown):
        if lang in SHELL_LANGS:
            for line in logical_lines(body):
                if m := INVOCATION.match(line):
                    found.append((m.group(1), m.group(2) or "", True))
    if inline:
        for span in INLINE_CODE.findall(prose(markdown)):
            if (m := INVOCATION.match(strip_comment(span))) and m.group(2):  # `specdecode` alone names the package
                found.append((m.group(1), m.group(2) or "", False))
    return found


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return None


def cli_problems(arguments: str, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """What in `specdecode ARGUMENTS` the CLI does not have: a subcommand, or a flag of the subcommand it
    is given to. Works on synopses too (`[--draft D | --ngram]`): every flag-shaped word is looked up."""
    parser = parser or build_parser()
    words = QUOTED.sub(" ", arguments).split()
    path = ["specdecode"]
    while (choices := _subcommands(parser)) is not None:
        if not words or words[0] not in choices:
            got = repr(words[0]) if words else "nothing"
            return [f"`{' '.join(path)}` has no subcommand {got} (it has {', '.join(choices)})"]
        parser = choices[words.pop(0)]
        path.append(parser.prog.split()[-1])
    known = parser._option_string_actions
    return [
        f"`{' '.join(path)}` has no option {flag}"
        for flag in FLAG.findall(" ".join(words))
        if flag.split("=")[0] not in known
    ]


def parse_problems(arguments: str, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """The CLI's own verdict on a concrete command line: argparse's error message, if it has one."""
    parser = parser or build_parser()
    arguments = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", arguments)  # $(command) is one word to argparse
    lexer = shlex.shlex(arguments, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word and set(word) <= set("();<>|&"):  # the next shell command starts here
            break
        words.append(word)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(words)
    except SystemExit as exc:
        if exc.code:
            lines = err.getvalue().strip().splitlines()
            return [f"`specdecode {arguments}`: {lines[-1] if lines else 'argparse exited'}"]
    return []


def make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-/ ]+?)\s*::?(?!=)", line):
            targets.update(m.group(1).split())
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
    return targets


def make_problems(arguments: str, targets: set[str] | None = None) -> list[str]:
    targets = make_targets() if targets is None else targets
    wanted = [w for w in QUOTED.sub(" ", arguments).split() if "=" not in w and not w.startswith("-")]
    return [f"`make {w}`: the Makefile has no target {w!r}" for w in wanted if w not in targets]


def python_problems(source: str, where: str = "README") -> list[str]:
    """The block compiles; every name it imports from specdecode exists; every keyword argument it passes
    to one of those names is a parameter of it."""
    try:
        tree = ast.parse(source)
        compile(source, where, "exec")
    except SyntaxError as exc:
        return [f"{where}: a Python block does not compile: {exc}"]
    problems, imported = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "specdecode":
                    try:
                        importlib.import_module(alias.name)
                    except ImportError as exc:
                        problems.append(f"{where}: import {alias.name}: {exc}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specdecode":
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                problems.append(f"{where}: from {node.module} import ...: {exc}")
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
                else:
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        problems.append(f"{where}: {node.module} has no {alias.name!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            callee = imported[node.func.id]
            try:  # LLM checks its options against EngineConfig's fields and says which
                params = (
                    getattr(getattr(callee, "__init__", None), "valid_options", None)
                    or inspect.signature(callee).parameters
                )
            except (TypeError, ValueError):
                continue
            if not isinstance(params, list) and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                continue
            problems += [
                f"{where}: {node.func.id}() has no argument {kw.arg!r}"
                for kw in node.keywords
                if kw.arg is not None and kw.arg not in params
            ]
    return problems


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(markdown), re.M):
        slug = github_slug(m.group(1))
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def link_problems(doc: Path, markdown: str | None = None) -> list[str]:
    """Relative links (and images) of a Markdown file that reach no file, or no heading of the file."""
    markdown = doc.read_text() if markdown is None else markdown
    problems = []
    for target in LINK.findall(prose(markdown)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        name = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
        if not file.exists():
            problems.append(f"{doc.name}: link to {target}: no file {name}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{doc.name}: link to {target}: {name} has no heading with anchor #{anchor}")
    return problems


# --- the checkers can fail ------------------------------------------------------------------------------


def test_checkers_report_what_does_not_exist():
    parser = build_parser()
    assert cli_problems("generate --max-tokens 5 --draft ngram hi", parser) == []
    assert cli_problems("bench latency -k 3 4 --vs-llama-cpp DIR", parser) == []
    assert any("--no-such-flag" in p for p in cli_problems("generate --no-such-flag hi", parser))
    assert any("--rounds" in p for p in cli_problems("bench latency --rounds 3", parser))  # bench concurrency's
    assert any("no-such-bench" in p for p in cli_problems("bench no-such-bench", parser))
    assert any("no subcommand" in p for p in cli_problems("--max-tokens 5", parser))
    assert parse_problems("generate --max-tokens 5 hi", parser) == []
    assert parse_problems("generate --no-such-flag hi", parser)
    assert parse_problems("generate --max-tokens five hi", parser)  # a flag that exists, given a bad value
    assert make_problems('demo PROMPT="x"') == []
    assert make_problems("no-such-target")
    assert python_problems("from specdecode import LLM\nLLM(model='m', num_speculative_tokens=2)") == []
    assert python_problems("from specdecode import NoSuchName")
    assert python_problems("from specdecode import LLM\nLLM(no_such_option=1)")
    assert python_problems("from specdecode.no_such_module import x")
    assert python_problems("print(")
    assert link_problems(README, "[a](docs/no-such-file.md) [b](docs/usage.md#no-such-heading)") != []
    assert len(link_problems(README, "[a](docs/no-such-file.md) [b](docs/usage.md#no-such-heading)")) == 2
    assert github_slug("Draft heads: `specdecode distill`") == "draft-heads-specdecode-distill"


def test_invocations_are_found_in_blocks_and_inline_code():
    text = (
        "```bash\nSPECDECODE_KERNELS=scalar .venv/bin/specdecode serve --port 1 \\\n    --api-key K &  # c --x\n"
        "make demo   # comment --y\n```\nRun `specdecode bench report DIR` or `make test-fast`.\n"
    )
    assert invocations(text) == [
        ("specdecode", "serve --port 1      --api-key K &", True),
        ("make", "demo", True),
        ("specdecode", "bench report DIR", False),
        ("make", "test-fast", False),
    ]


# --- the README -----------------------------------------------------------------------------------------


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {MAX_README_LINES})"


def test_readme_commands_exist():
    parser, targets, problems = build_parser(), make_targets(), []
    found = invocations(README.read_text())
    assert any(program == "specdecode" for program, _, fenced in found if fenced)
    for program, arguments, fenced in found:
        if program == "make":
            problems += make_problems(arguments, targets)
        else:
            unknown = cli_problems(arguments, parser)
            # a concrete command (fenced, not a synopsis): argparse must accept the whole line too
            problems += unknown or (parse_problems(arguments, parser) if fenced else [])
    assert not problems, "\n".join(problems)


def test_readme_python_examples_compile_and_import():
    blocks = [body for lang, body in code_blocks(README.read_text()) if lang in ("python", "py")]
    assert blocks
    problems = [p for body in blocks for p in python_problems(body, "README.md")]
    assert not problems, "\n".join(problems)


def test_ci_runs_what_the_readme_says():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize(
    "doc", [README, *sorted((ROOT / "docs").rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_relative_links_resolve(doc):
    problems = link_problems(doc)
    assert not problems, "\n".join(problems)


# --- the full reference ---------------------------------------------------------------------------------


def test_usage_reference_flags_and_examples_exist():
    text = USAGE.read_text()
    parser, problems = build_parser(), []
    for program, arguments, _ in invocations(text, inline=False):
        problems += cli_problems(arguments, parser) if program == "specdecode" else make_problems(arguments)
    problems += [
        p
        for lang, body in code_blocks(text)
        if lang in ("python", "py")
        for p in python_problems(body, "docs/usage.md")
    ]
    assert not problems, "\n".join(problems)


def test_the_options_table_in_usage_is_the_one_config_defines():
    """docs/usage.md's options table is generated from EngineConfig (python tools/options_table.py): a default or
    help changed in config.py without writing the table again fails here."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from options_table import with_table

    usage = (ROOT / "docs" / "usage.md").read_text()
    assert with_table(usage) == usage, "docs/usage.md's options table is stale: run python tools/options_table.py"


def _table_after(marker: str) -> list[list[str]]:
    """The cells of the first Markdown table after the line that starts with `marker` (bold marks dropped)."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    rows = []
    for line in lines[start:]:
        if line.startswith("|"):
            rows.append([cell.strip().strip("*") for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


BATCH_1_RUNS = {  # the README's batch-1 columns and the runs they come from
    "Zen 5": "latency-humaneval-head-zen5.json",
    "Zen 2": "latency-humaneval-gpuhead-zen2.json",
    "Ice Lake": "latency-humaneval-avx512.json",
    "Zen 4": "latency-humaneval-zen4-one-call.json",
    "Xeon AMX": "latency-humaneval-head-xeon-amx.json",
}
BATCH_1_CONFIGS = {
    "llama.cpp, plain": ("llama.cpp: plain (mean)",),
    "llama.cpp, 0.5B draft, k=3": ("llama.cpp: draft k=3", "llama.cpp: draft k=3, no repack"),
    "ours, plain": ("cpu w4a8: plain",),
    "ours, 0.5B draft, k=3, conf 0.8": ("cpu w4a8: draft k=3 conf 0.8",),
    "ours, GPU-trained head (the default), k=3, conf 0.8": ("cpu w4a8: head k=3 conf 0.8",),
    "ours, CPU-recipe head, k=2, conf 0.8": ("cpu w4a8: head k=2 conf 0.8",),
    "ours, n-gram, k=3": ("cpu w4a8: ngram k=3",),
}


def _rates(run: str) -> dict[str, float]:
    """A batch-1 run's decoding rate by config, from its JSON in docs/bench."""
    return {r["config"]: r["tokens_per_s"] for r in json.loads((ROOT / "docs" / "bench" / run).read_text())["results"]}


def test_the_readme_figures_are_those_of_the_runs_it_cites():
    """Every figure of the README's batch-1 and under-load tables is its run's JSON value, as printed (2 places),
    and each ratio is computed from the same JSON."""
    for column, run in enumerate(BATCH_1_RUNS.values()):
        rates = _rates(run)
        reference = rates["llama.cpp: plain (mean)"]
        for label, *cells in _table_after("| config | Zen 5 tok/s"):
            rate, ratio = cells[2 * column], cells[2 * column + 1]
            if rate == "-":
                continue
            measured = next(rates[c] for c in BATCH_1_CONFIGS[label] if c in rates)
            assert (rate, ratio) == (f"{measured:.2f}", f"{measured / reference:.2f}"), (run, label)
    under_load_run = ROOT / "docs" / "bench" / "concurrency-humaneval-head-llama-server-zen5.json"
    under_load = json.loads(under_load_run.read_text())["results"]
    rates = {(r["config"], r["concurrency"]): r["output_throughput"] for r in under_load}
    for concurrency, plain, adaptive, server, server_draft in _table_after("| concurrency | ours, plain"):
        c = int(concurrency)
        expected = [rates["plain", c], rates["adaptive", c], rates["llama.cpp", c], rates["llama.cpp-draft", c]]
        ratio = f" ({rates['adaptive', c] / rates['plain', c]:.2f}×)"
        assert [plain, adaptive.replace(ratio, ""), server, server_draft] == [f"{v:.2f}" for v in expected], c


def _limitations() -> str:
    text = README.read_text()
    return text[text.index("## Limitations") : text.index("## Documentation")]


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}×"


def test_the_limitations_cite_the_figures_of_the_runs_they_sum_up():
    """The Limitations' batch-1 gain is the span over the batch-1 table's hosts of its best drafter's rate against
    our plain decoding and against llama.cpp's, from the same JSON; the head against context length is its log's
    geometric means. A table changed alone leaves a stale sum here, which fails."""
    over_ours, over_llama_cpp = [], []
    drafters = [c for label, configs in BATCH_1_CONFIGS.items() if label.startswith("ours, ") for c in configs]
    for run in BATCH_1_RUNS.values():
        rates = _rates(run)
        best = max(rates[c] for c in drafters if c in rates and c != "cpu w4a8: plain")
        over_ours.append(best / rates["cpu w4a8: plain"])
        over_llama_cpp.append(best / rates["llama.cpp: plain (mean)"])
    limitations = " ".join(_limitations().split())
    assert f"reads {_span(over_ours)} our plain decoding on the five hosts ({_span(over_llama_cpp)} llama.cpp's)" in (
        limitations
    )
    log = (ROOT / "docs" / "bench" / "long-context-head-xeon-amx-continuations.log").read_text()
    means = dict(re.findall(r"^head:\S+, (\d+) tokens over \d+ continuations: ([\d.]+)×", log, re.M))
    assert f"{means['1024']}× plain at 1k tokens of context and {means['16384']}× at 16k" in limitations


def test_measurements_md_is_what_its_script_writes_from_the_json():
    """docs/measurements.md's tables come from docs/bench/*.json (python tools/measurements.py): a run's JSON or
    the file changed alone fails here."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from measurements import render

    written = (ROOT / "docs" / "measurements.md").read_text()
    assert render() == written, "docs/measurements.md is stale: run python tools/measurements.py"
