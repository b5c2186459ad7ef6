"""Which cells of a notebook feed which: the names each code cell defines and uses.

The test suite runs each lab notebook (its exercises stubbed) to prove that every check fails
on its stub and that a student with stubs gets through every cell not tagged `needs-solution`.
A cell that reads nothing an exercise produced runs the same code on the same inputs in the lab
as in the solution, whose run already executes it; `cells_the_lab_runs` picks the others:
- `untagged_uses`: the cells that may read an exercise's result (a name an exercise cell's
  answer binds, or one a `needs-solution` cell binds) and are not tagged `needs-solution`;
- the exercise and check cells, the cells that start, stop or change the engines,
- and whatever those read, transitively.

A cell's source is read as Python once IPython's magics are taken off (`%%px` and its options,
`%px` before a statement, other `%` and `!` lines dropped). Names are the module level's: what
assignments, imports, `def` and `class` bind, and every name read anywhere in the cell (strings
that are identifiers count as reads too, so `view.pull("x")` reads x). A cell that does not
parse, or has a star import, defines and reads everything: it is always needed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import nbformat

CHECK_TAG, NEEDS_TAG = "check", "needs-solution"
EXERCISE_MARK = "### BEGIN SOLUTION"
#: A call that changes the engines; a cell holding one runs in every run of the lab.
ENGINES = re.compile(r"\bcluster\s*\.\s*\w+\s*\(")
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")
#: The kernel's namespace and the engines' (`%%px` cells); a string naming a variable may be either.
NAMESPACES = ("kernel", "engines")


@dataclass(frozen=True)
class CellNames:
    """What one code cell binds at module level and what it reads, each as "namespace:name" (see
    `namespaces`); `opaque` if it cannot be read."""

    defines: frozenset[str]
    uses: frozenset[str]
    opaque: bool = False


def python_of(source: str) -> str:
    """The cell's source as plain Python: cell magics' first line and `%`/`!` lines off, `%px ` prefixes off."""
    lines = source.split("\n")
    if lines and lines[0].lstrip().startswith("%%"):
        lines = lines[1:]
    out = []
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith("%px "):
            out.append(line[: len(line) - len(stripped)] + stripped[4:])
        elif stripped.startswith(("%", "!")):
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def _bound(node: ast.AST, into: set[str]) -> None:
    """Names bound at module level by the statement `node` (not inside functions or classes)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        into.add(node.name)
        return
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        into.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        return
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
            into.add(child.id)
        elif isinstance(child, (ast.stmt, ast.expr, ast.excepthandler, ast.withitem, ast.comprehension)):
            if not isinstance(child, (ast.Lambda, ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)):
                _bound(child, into)
        if isinstance(child, ast.ExceptHandler) and child.name:
            into.add(child.name)


def cell_names(source: str) -> CellNames:
    """What a code cell defines and uses (see the module's docstring)."""
    try:
        tree = ast.parse(python_of(source))
    except SyntaxError:
        return CellNames(frozenset(), frozenset(), opaque=True)
    if any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree)):
        return CellNames(frozenset(), frozenset(), opaque=True)
    spaces = namespaces(source)
    bound: set[str] = set()
    read: set[str] = set()
    _walk(tree.body, bound, read)
    uses = {f"{space}:{name}" for space in spaces for name in read}
    uses |= {f"{space}:{text}" for space in NAMESPACES for text in _pulled(tree)}
    defines = {f"{space}:{name}" for space in spaces for name in bound} | {f"engines:{k}" for k in _pushed(tree)}
    return CellNames(frozenset(defines), frozenset(uses))


def _walk(statements: list[ast.stmt], bound: set[str], read: set[str]) -> None:
    """Statements in order: what each reads before the cell bound it, then what it binds. A compound
    statement's header first, then its bodies the same way (so a loop that binds x and then reads
    it reads its own x)."""
    for statement in statements:
        bodies: list[list[ast.stmt]] = [
            body
            for name in ("body", "orelse", "finalbody")
            if isinstance(body := getattr(statement, name, None), list) and body and isinstance(body[0], ast.stmt)
        ]
        handlers: list[ast.ExceptHandler] = getattr(statement, "handlers", [])
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not bodies:
            read |= _reads(statement) - bound
            _bound(statement, bound)
            continue
        headers: list[ast.AST] = [
            part for name in ("test", "iter", "subject") if isinstance(part := getattr(statement, name, None), ast.AST)
        ]
        items: list[ast.withitem] = getattr(statement, "items", [])
        headers += [item.context_expr for item in items]
        for node in headers:
            read |= _reads(node) - bound
        targets = [getattr(statement, "target", None), *(item.optional_vars for item in items)]
        bound |= {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
        for handler in handlers:
            read |= (_reads(handler.type) if handler.type else set()) - bound
            if handler.name:
                bound.add(handler.name)
            _walk(handler.body, bound, read)
        for body in bodies:
            _walk(body, bound, read)


def namespaces(source: str) -> tuple[str, ...]:
    """Where a cell's names live: the engines' namespace (`%%px`), the kernel's, or both (`%px` lines)."""
    if source.lstrip().startswith("%%px"):
        return ("engines",)
    if re.search(r"^\s*%px ", source, re.MULTILINE):
        return NAMESPACES
    return ("kernel",)


def _reads(node: ast.AST) -> set[str]:
    """The names `node` reads: loaded names and augmented assignments' targets."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            found.add(n.id)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            found.add(n.target.id)
    return found


def _pushed(tree: ast.AST) -> set[str]:
    """Names bound on the engines by string: `view.push({"x": value})` (ipyparallel)."""
    return {
        key.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "push"
        for arg in n.args
        if isinstance(arg, ast.Dict)
        for key in arg.keys
        if isinstance(key, ast.Constant) and isinstance(key.value, str)
    }


def _pulled(tree: ast.AST) -> set[str]:
    """Names read from the other namespace by string: `view.pull("x")` or `view.pull(["x", "y"])` (ipyparallel)."""
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "pull":
            for arg in n.args:  # a name, or a list of them
                for item in arg.elts if isinstance(arg, (ast.List, ast.Tuple, ast.Set)) else [arg]:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str) and _IDENTIFIER.match(item.value):
                        found.add(item.value)
    return found


def _tags(cell: nbformat.NotebookNode) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def is_exercise(cell: nbformat.NotebookNode) -> bool:
    return cell.cell_type == "code" and EXERCISE_MARK in cell.source


def exercise_results(source: str) -> set[str]:
    """What an exercise cell binds that the lab's stub changes: its functions and classes (whose
    bodies hold the answer), and whatever a statement holding an answer block binds (as
    "namespace:name", as CellNames has them)."""
    try:
        tree = ast.parse(python_of(source))
    except SyntaxError:
        return set()
    lines = python_of(source).split("\n")
    blocks = [n for n, line in enumerate(lines, 1) if line.strip() == EXERCISE_MARK]
    found: set[str] = set()
    for statement in tree.body:
        end = statement.end_lineno or statement.lineno
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or any(
            statement.lineno <= n <= end for n in blocks
        ):
            _bound(statement, found)
    return {f"{space}:{name}" for space in namespaces(source) for name in found}


def _imported(source: str) -> set[str]:
    """What a cell's imports bind (never an exercise's result), as "namespace:name"."""
    try:
        tree = ast.parse(python_of(source))
    except SyntaxError:
        return set()
    names = {
        (a.asname or a.name).split(".")[0]
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    return {f"{space}:{name}" for space in namespaces(source) for name in names}


def untagged_uses(notebook: nbformat.NotebookNode) -> list[tuple[int, list[str]]]:
    """(cell index, the exercise-derived names it reads) for each code cell that reads one untagged.

    Exercise-derived: what an exercise cell binds that its stub changes (`exercise_results`), or
    what a cell tagged `needs-solution` binds. Exercise and check cells are not reported."""
    derived: set[str] = set()
    found = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        names = cell_names(cell.source)
        tags = _tags(cell)
        if is_exercise(cell):
            derived |= exercise_results(cell.source)
            continue
        if NEEDS_TAG in tags:
            derived |= names.defines - _imported(cell.source)
            continue
        if CHECK_TAG in tags:
            continue
        read = sorted(names.uses & derived)
        if read:
            found.append((index, read))
            derived |= names.defines - _imported(cell.source)  # made from an exercise's result
        else:
            derived -= names.defines  # rebound from something else: no longer the exercise's
    return found


def cells_the_lab_runs(solution: nbformat.NotebookNode) -> set[int]:
    """Indices of the code cells the lab's run executes (the lab has the solution's cells, stubbed).

    The roots: the first and last code cells (they start and stop the engines), every exercise and
    check cell, every cell that changes the engines (`cluster.` calls) or cannot be read, and every
    cell `untagged_uses` names (it may read an exercise's result, so the lab's run must show that it
    still runs on the stubs); then, transitively, the latest earlier cell binding each name a
    needed cell reads. Every other cell runs the solution's code on the solution's inputs, which the
    solution's own run executes."""
    code = [i for i, cell in enumerate(solution.cells) if cell.cell_type == "code"]
    if not code:
        return set()
    names = {i: cell_names(solution.cells[i].source) for i in code}
    roots = {code[0], code[-1]} | {i for i, _ in untagged_uses(solution)}
    for i in code:
        cell = solution.cells[i]
        if is_exercise(cell) or CHECK_TAG in _tags(cell) or names[i].opaque or ENGINES.search(cell.source):
            roots.add(i)
    needed: set[int] = set()
    todo = sorted(roots)
    while todo:
        i = todo.pop()
        if i in needed:
            continue
        needed.add(i)
        earlier = [j for j in code if j < i]
        for name in names[i].uses:
            for j in reversed(earlier):  # the latest cell before i that binds it
                if name in names[j].defines:
                    todo.append(j)
                    break
        todo.extend(j for j in earlier if names[j].opaque)
    return needed
