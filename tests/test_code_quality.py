"""The code stays linted, formatted and typed, and the library's packages stay layered.

ruff (check and format, with the settings in lib/pyproject.toml) over lib/, tests/ and
bench/; mypy over lib/ddlab; and the import graph between ddlab's packages, read from the
source, has no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib"
BIN = Path(sys.executable).parent
#: What ruff checks and formats, from the repository's root.
LINTED = ["lib", "tests", "bench", "conftest.py", "docs/figures.py"]


def run(tool: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    done = run("ruff", "check", "--config", "lib/pyproject.toml", *LINTED)
    assert done.returncode == 0, (
        f"ruff check (run `ruff check --config lib/pyproject.toml --fix {' '.join(LINTED)}`):\n{done.stdout}{done.stderr}"
    )


def test_ruff_format_changes_nothing():
    done = run("ruff", "format", "--check", "--config", "lib/pyproject.toml", *LINTED)
    assert done.returncode == 0, (
        f"ruff format (run `ruff format --config lib/pyproject.toml {' '.join(LINTED)}`):\n{done.stdout}{done.stderr}"
    )


def test_mypy_finds_nothing():
    done = run("mypy", cwd=LIB)
    assert done.returncode == 0, f"mypy (run `mypy` in lib/):\n{done.stdout}{done.stderr}"


def package_imports(library: Path) -> dict[str, set[str]]:
    """Which of ddlab's packages (and top-level modules) each imports, lazy imports included."""
    graph: dict[str, set[str]] = {}
    for path in sorted((library / "ddlab").rglob("*.py")):
        parts = list(path.relative_to(library).with_suffix("").parts)  # ["ddlab", package, ..., module]
        if len(parts) < 3:
            continue  # ddlab/__init__.py
        package, here = parts[:-1], parts[1]  # where relative imports start; the top-level package
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")
                if top[0] == "ddlab" and len(top) > 1 and top[1] != here and (library / "ddlab" / top[1]).exists():
                    graph.setdefault(here, set()).add(top[1])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_packages():
    graph = package_imports(LIB)
    assert "runtime" in graph["allreduce"] and "allreduce" in graph["data_parallel"], graph  # the graph is read at all
    cycle = find_cycle(graph)
    assert cycle is None, "packages import each other in a cycle: " + " -> ".join(cycle or [])


def test_the_layers_depend_downwards():
    """docs/architecture.md's three layers: the runtime stands on nothing else of ddlab; only tools/ uses tools/."""
    graph = package_imports(LIB)
    assert not graph.get("runtime"), f"runtime/ must import nothing else of ddlab, it imports {graph.get('runtime')}"
    users = sorted(package for package, imported in graph.items() if "tools" in imported)
    assert not users, f"tools/ is the operator's layer, on top: {users} import it"


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
