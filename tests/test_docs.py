"""The documentation tells the truth about the code, and the README stays a front door.

- Every file path, `ddlab.*` module (and name in it), `make` target, `python -m` module and
  `ddlab <subcommand>` named in README.md, CONTRIBUTING.md, docs/*.md and the cluster profile's
  README it links exists; every relative link points at a file, and every #anchor at a
  heading of it.
- docs/architecture.md cannot drift: its lab -> package -> checks table matches the packages,
  `ddlab.checks` and the solution notebooks, and its drawing of lib/ddlab lists exactly the
  packages and modules there.
- The README is at most 160 lines, links every page of docs/, and its picture is small and is
  what docs/figures.py draws.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
from collections.abc import Iterator
from pathlib import Path

import nbformat
import numpy as np
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"
ARCHITECTURE = DOCS_DIR / "architecture.md"
LIBRARY = ROOT / "lib" / "ddlab"
#: The pages checked: the README, and every page it links to.
PAGES = [
    README,
    ROOT / "CONTRIBUTING.md",
    *sorted(DOCS_DIR.glob("*.md")),
    ROOT / "clusters" / "jupyterhub" / "README.md",
]
README_MAX_LINES = 160
PICTURE_MAX_BYTES = 200 * 1024
PICTURE_TOLERANCE = 0.02  # share of pixels that may differ from a fresh drawing

#: Paths the pages name that are not in the repository, by design: what the reader writes or a tool
#: outputs. Each must still be named somewhere (a stale entry fails too).
NOT_IN_REPOSITORY = {
    "nbgrader_config.py": "the instructor writes it in the nbgrader course folder",
    "source/<assignment>/": "nbgrader's course folder",
    "collected/*.ipynb": "the submissions an instructor collected",
    "grades/grades.csv": "written by `ddlab grade --out grades`",
    "grades/feedback/<student>.html": "written by `ddlab grade --out grades`",
    "submitted/<student>/<assignment>/03_allreduce.ipynb": "nbgrader's layout of submissions",
    "out/browser/": "written by a failed browser test",
    "build/site": "written by `make site`",
    "build/site/html/": "written by `make site`",
    "canvas-export.csv": "the gradebook an instructor exports from Canvas",
    "grades/canvas-03.csv": "written by `ddlab grade --canvas`",
    "setup.sh": "in the Gradescope autograder that `ddlab grade --gradescope` writes",
    "submission/": "Gradescope's folder of a student's upload",
    "results/results.json": "written by the Gradescope autograder",
}
#: Extensions that make a bare word (no slash) a file name to look for.
FILE_EXTENSIONS = (".py", ".md", ".ipynb", ".yml", ".yaml", ".toml", ".txt", ".sh", ".png", ".csv", ".html", ".ini")
STRIP = "`'\",;:()[]{}"


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _fenced_blocks(text: str) -> Iterator[tuple[str, list[str]]]:
    """(language, lines) of every ``` block."""
    language: str | None = None
    block: list[str] = []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if language is None:
                language, block = line.strip()[3:].strip(), []
            else:
                yield language, block
                language = None
        elif language is not None:
            block.append(line)


def _prose(text: str) -> str:
    """The text outside ``` blocks."""
    kept, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


def _is_tree(block: list[str]) -> bool:
    return bool(block) and block[0].strip() == "lib/ddlab/"


def _code(text: str) -> list[str]:
    """Every piece of code a page shows: inline spans and the lines of commands in ``` blocks."""
    pieces = re.findall(r"`([^`\n]+)`", _prose(text))
    for language, block in _fenced_blocks(text):
        if _is_tree(block):
            continue  # checked exactly by test_the_tree_drawing_lists_exactly_what_lib_ddlab_holds
        if language in ("sh", "bash", "console"):
            pieces += block
        else:  # listings and program output: only a leading path is a claim about the repository
            pieces += [line.split()[0] for line in block if line.split() and "/" in line.split()[0]]
    return pieces


def _path_words(page: Path) -> set[str]:
    words = set()
    for piece in _code(page.read_text()):
        for word in piece.split():
            word = word.strip(STRIP)
            if not word or word[0] in "/~$-" or "=" in word or "://" in word or ".venv" in word:
                continue  # absolute, home, variables, options, URLs, the environment make setup creates
            if "/" in word or word.endswith(FILE_EXTENSIONS):
                words.add(word)
    return words


def _exists(word: str) -> bool:
    pattern = re.sub(r"<[^>]+>", "*", word)
    if "/" not in word:  # a bare file name: somewhere in the repository
        return any(p for p in ROOT.rglob(pattern) if ".venv" not in p.parts and ".git" not in p.parts)
    if "*" in pattern:
        return any(ROOT.glob(pattern.rstrip("/")))
    return (ROOT / word).exists()


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_path_named_exists(page: Path):
    missing = sorted(w for w in _path_words(page) if w not in NOT_IN_REPOSITORY and not _exists(w))
    assert not missing, (
        f"{_rel(page)} names paths that do not exist (relative to the repository root; "
        f"<placeholders> may match anything): {missing}. Fix the page, or if the path is "
        f"written by a tool or the reader, add it to NOT_IN_REPOSITORY with the reason"
    )


def test_the_paths_not_in_the_repository_are_still_named():
    named = set().union(*(_path_words(page) for page in PAGES))
    stale = sorted(set(NOT_IN_REPOSITORY) - named)
    assert not stale, f"NOT_IN_REPOSITORY lists paths no page names any more: remove {stale}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", _prose(page.read_text()), re.MULTILINE)}


def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_points_at_a_file_and_heading(page: Path):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not checked offline
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no file {path.relative_to(ROOT) if ROOT in path.parents else path})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no heading with anchor #{anchor} in {_rel(path)})")
    assert not broken, f"{_rel(page)} has broken links: {broken}"


def _resolve(dotted: str) -> str | None:
    """None if `dotted` is an importable module or a name in one; else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a parent is a module, not a package
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(module)
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return f"{dotted}: module {module} has no {'.'.join(parts[cut:])}"
            obj = getattr(obj, name)
        return None
    return f"{dotted}: no such module"


def _ddlab_names(text: str) -> set[str]:
    names = set()
    for match in re.finditer(r"\bddlab(?:\.[A-Za-z_]\w*)+", text):
        name = match.group()
        if text[match.end() : match.end() + 1] == "<":  # ddlab.checks.check_<exercise>: a placeholder
            name = name.rsplit(".", 1)[0]
        names.add(name)
    return names


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_ddlab_module_named_exists(page: Path):
    problems = sorted(p for p in map(_resolve, _ddlab_names(page.read_text())) if p)
    assert not problems, f"{_rel(page)} names ddlab modules or names that do not exist: {problems}"


def _make_targets() -> set[str]:
    """Targets with a rule (a name only in .PHONY is not one)."""
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.MULTILINE))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_make_target_named_exists(page: Path):
    named = {m for piece in _code(page.read_text()) for m in re.findall(r"\bmake ([a-z][\w-]*)", piece)}
    missing = sorted(named - _make_targets())
    assert not missing, f"{_rel(page)} names make targets the Makefile does not have: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_python_m_module_named_exists(page: Path):
    named = {m for piece in _code(page.read_text()) for m in re.findall(r"python[\w.]*\s+-m\s+([\w.]+)", piece)}
    missing = sorted(m for m in named if importlib.util.find_spec(m) is None)
    assert not missing, f"{_rel(page)} names `python -m` modules that cannot be found: {missing}"


def _ddlab_subcommands() -> set[str]:
    """The subcommands of the `ddlab` console script, from its own --help."""
    entry = tomllib.loads((ROOT / "lib" / "pyproject.toml").read_text())["project"]["scripts"]["ddlab"]
    module, _, function = entry.partition(":")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        getattr(importlib.import_module(module), function)(["--help"])
    choices = re.search(r"\{([\w,-]+)\}", out.getvalue())
    assert choices, f"`ddlab --help` lists no subcommands:\n{out.getvalue()}"
    return set(choices.group(1).split(","))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_ddlab_subcommand_named_exists(page: Path):
    named = {m for piece in _code(page.read_text()) for m in re.findall(r"\bddlab ([a-z][\w-]*)", piece)}
    named.discard("import")
    missing = sorted(named - _ddlab_subcommands())
    assert not missing, f"{_rel(page)} names `ddlab` subcommands the command does not have: {missing}"


# --- docs/architecture.md against the code ---------------------------------------------------


def _lab_rows() -> list[tuple[str, Path, list[str], list[str]]]:
    """(lab, solution notebook, packages, checks) per row of the lab -> package -> checks table."""
    rows = []
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"\d\d", cells[0]):
            link = re.search(r"\]\(([^)]+)\)", cells[1])
            assert link, f"architecture.md, lab {cells[0]}: the notebook column needs a link to the solution"
            rows.append(
                (
                    cells[0],
                    (ARCHITECTURE.parent / link.group(1)).resolve(),
                    re.findall(r"`([\w.]+)`", cells[2]),
                    re.findall(r"`(\w+)`", cells[3]),
                )
            )
    assert rows, "docs/architecture.md has no lab table (rows like | 03 | [03_allreduce](...) | `allreduce` | ...)"
    return rows


def _called_checks(notebook: Path) -> set[str]:
    source = "\n".join(c.source for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code")
    return set(re.findall(r"\b(check_\w+)\(", source))


def test_lab_table_matches_packages_checks_and_notebooks():
    import ddlab.checks

    problems = []
    rows = _lab_rows()
    for lab, notebook, packages, checks in rows:
        if not notebook.exists() or notebook.parent != ROOT / "solutions" or not notebook.name.startswith(lab):
            problems.append(f"lab {lab}: {notebook} is not a solution notebook of lab {lab}")
            continue
        problems += [f"lab {lab}: no package ddlab.{p}" for p in packages if _resolve(f"ddlab.{p}")]
        called = _called_checks(notebook)
        for check in checks:
            if not hasattr(ddlab.checks, check):
                problems.append(f"lab {lab}: ddlab.checks has no {check}")
            elif check not in called:
                problems.append(f"lab {lab}: {check} is never called in {notebook.name}")
        problems += [
            f"lab {lab}: {notebook.name} calls {c}, missing from its row" for c in sorted(called - set(checks))
        ]
    tabled = [c for *_, checks in rows for c in checks]
    every = {name for name in ddlab.checks.__all__ if name.startswith("check_")}
    problems += [f"{c} (in ddlab.checks) is in no row of the table" for c in sorted(every - set(tabled))]
    problems += [f"{c} is in more than one row" for c in sorted({c for c in tabled if tabled.count(c) > 1})]
    labs = {lab for lab, *_ in rows}
    problems += [f"{p.name} has no row" for p in sorted(ROOT.glob("solutions/*.ipynb")) if p.name[:2] not in labs]
    assert not problems, "docs/architecture.md's lab table disagrees with the code:\n  " + "\n  ".join(problems)


def _drawn_tree() -> set[str]:
    """Paths under lib/ddlab/ the drawing names: 'runtime/', 'runtime/cluster.py', ..."""
    blocks = [b for _, b in _fenced_blocks(ARCHITECTURE.read_text()) if _is_tree(b)]
    assert len(blocks) == 1, "docs/architecture.md needs exactly one ``` block starting with the line lib/ddlab/"
    drawn: set[str] = set()
    stack: list[str] = []
    for line in blocks[0][1:]:
        if not line.strip() or line.strip().startswith("#"):
            continue  # blank, or a layer's heading
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0 and indent >= 2, f"architecture.md tree: indent by 2 spaces per level: {line!r}"
        depth, name = indent // 2 - 1, line.split()[0]
        assert depth <= len(stack), f"architecture.md tree: {line!r} is indented deeper than its parent"
        stack = [*stack[:depth], name]
        drawn.add("".join(stack))
    return drawn


def _library_tree() -> set[str]:
    """Every package under lib/ddlab, and the modules of lib/ddlab itself, runtime/ and tools/."""
    present = set()
    for init in LIBRARY.rglob("__init__.py"):
        if init.parent != LIBRARY:
            present.add(str(init.parent.relative_to(LIBRARY)) + "/")
    for folder in (LIBRARY, LIBRARY / "runtime", LIBRARY / "tools"):
        present.update(str(m.relative_to(LIBRARY)) for m in folder.glob("*.py") if m.name != "__init__.py")
    return present


def test_the_tree_drawing_lists_exactly_what_lib_ddlab_holds():
    drawn, present = _drawn_tree(), _library_tree()
    assert drawn == present, (
        "docs/architecture.md's drawing of lib/ddlab has drifted (it names every package, and the modules of "
        f"lib/ddlab, runtime/ and tools/).\n  drawn but missing from lib/ddlab: {sorted(drawn - present)}"
        f"\n  in lib/ddlab but not drawn: {sorted(present - drawn)}"
    )


# --- the README --------------------------------------------------------------------------------


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into the page of docs/ for its reader"
    )


def test_readme_links_every_page():
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _links(README)}
    pages = [ROOT / "CONTRIBUTING.md", *sorted(DOCS_DIR.glob("*.md"))]
    unlinked = [_rel(p) for p in pages if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}: every page must be reachable from it"


def test_readme_picture_is_small_and_drawn_by_docs_figures(tmp_path: Path):
    import matplotlib.image

    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README.read_text())
    assert len(images) == 1, f"README.md should show one picture, found {images}"
    picture = ROOT / images[0]
    assert picture.exists(), f"README.md shows {images[0]}, which does not exist: run .venv/bin/python docs/figures.py"
    assert picture.stat().st_size < PICTURE_MAX_BYTES, (
        f"{images[0]} is {picture.stat().st_size} bytes: keep it < 200 KB"
    )
    spec = importlib.util.spec_from_file_location("docs_figures", DOCS_DIR / "figures.py")
    assert spec and spec.loader
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    assert figures.OUT == picture, f"docs/figures.py writes {figures.OUT}, README.md shows {picture}"
    fresh, committed = matplotlib.image.imread(figures.draw(tmp_path / picture.name)), matplotlib.image.imread(picture)
    assert fresh.shape == committed.shape, (
        f"{images[0]} is {committed.shape[1]}x{committed.shape[0]} px, docs/figures.py draws "
        f"{fresh.shape[1]}x{fresh.shape[0]}: run .venv/bin/python docs/figures.py and commit the picture"
    )
    # Another matplotlib or FreeType moves a few glyph pixels; a changed schedule or chart moves bars (8-14%).
    differing = float((np.abs(fresh - committed).max(axis=-1) > 0.1).mean())
    assert differing <= PICTURE_TOLERANCE, (
        f"{images[0]} differs from what docs/figures.py draws now in {differing:.1%} of its pixels: "
        "run .venv/bin/python docs/figures.py and commit the picture"
    )
