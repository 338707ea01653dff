"""The package's shape: no import cycles, engine modules of a readable size, no function over 60 lines, no history
in the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specdecode"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    """Every import statement, at any depth, except those under `if TYPE_CHECKING:` (never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking_block(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module-level and inside functions alike)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            graph[name].update(t for t in targets if t in files and t.split(".")[0] == top and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_package_has_no_import_cycles():
    graph = import_graph(PACKAGE)
    assert "specdecode.engine.engine" in graph and graph["specdecode.engine.engine"]  # the graph is real
    assert find_cycles(graph) == []


def test_the_cycle_check_catches_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("NOTE = 1\n\ndef main():\n    from .sub.cmd import run\n    return run()\n")
    (pkg / "sub" / "cmd.py").write_text("from ..cli import NOTE\n\ndef run():\n    return NOTE\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .cli import NOTE\n")
    (pkg / "cli2.py").write_text("from . import typed\n")
    assert find_cycles(import_graph(pkg)) == [["pkg.cli", "pkg.sub.cmd"]]


def test_engine_modules_stay_readable():
    sizes = {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in (PACKAGE / "engine").rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > 300} == {}


def long_functions(root: Path, limit: int = 60) -> list[str]:
    """Functions (methods and nested ones too) of more than `limit` lines under root."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit:
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name}")
    return found


def test_no_function_is_over_sixty_lines():
    assert long_functions(PACKAGE) == []


def test_the_length_check_sees_a_long_method(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path) == ["m.py:5 long"]


@pytest.mark.parametrize(
    "pattern",
    [
        r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b",  # a commit hash
        r"\b(was|were) tried\b",  # an experiment log
        r"DESIGN\.md",  # a document the repository does not have
    ],
)
def test_code_carries_no_history(pattern):
    hits = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(pattern, line)
    ]
    assert hits == []
