"""The repository as committed: labs in sync with solutions, no outputs, one package list."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from ddlab.tools.labgen import generate

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("solutions/*.ipynb")) + sorted(ROOT.glob("labs/*.ipynb"))


def test_labs_are_what_the_generator_makes():
    wanted = generate(ROOT / "solutions", ROOT / "labs")
    assert wanted, "no solution notebooks found"
    present = set((ROOT / "labs").glob("*.ipynb"))
    assert present == set(wanted), "labs/ and solutions/ hold different notebooks: run `make labs`"
    stale = [p.name for p, text in wanted.items() if p.read_text() != text]
    assert not stale, f"labs/ is out of date for {stale}: run `make labs` (never edit labs/ by hand)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebooks_carry_no_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"
    assert nb.metadata.get("kernelspec", {}).get("name") == "ddlab", f"{path.name}: use the ddlab kernel"


@pytest.mark.parametrize("path", sorted(ROOT.glob("solutions/*.ipynb")), ids=lambda p: p.name)
def test_solution_notebooks_follow_the_course_shape(path: Path):
    nb = nbformat.read(path, as_version=4)
    first, second, last = nb.cells[0], nb.cells[1], nb.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# Lab "), "cell 1: title"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "cluster.start(" in code[0].source, "the first code cell starts the cluster"
    assert "cluster.stop()" in last.source, "the last cell stops the cluster"
    assert second.cell_type == "markdown" or "cluster.start(" in second.source


def _requirement_names(requirements: list[str]) -> dict[str, str]:
    """{name: lower bound} from PEP 508 strings like 'numpy>=1.24'."""
    out = {}
    for requirement in requirements:
        if ";" in requirement:  # a shim for old Pythons only, not a course package
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(?:>=\s*([\w.]+))?", requirement.strip())
        assert match, f"unexpected requirement form: {requirement}"
        out[match.group(1).lower()] = match.group(2) or ""
    return out


# PyPI names whose conda-forge package is called differently.
CONDA_NAMES = {"torch": "pytorch-cpu"}


def test_environment_yml_lists_what_pyproject_lists():
    project = tomllib.loads((ROOT / "lib" / "pyproject.toml").read_text())["project"]
    pip_side = _requirement_names(project["dependencies"])
    for extra in ("openmpi", "test"):
        pip_side.update(_requirement_names(project["optional-dependencies"][extra]))
    pip_side = {CONDA_NAMES.get(name, name): bound for name, bound in pip_side.items()}

    conda_side = {}
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        match = re.fullmatch(r"\s+-\s+([A-Za-z0-9_.-]+)\s*(?:>=\s*([\w.]+))?\s*(#.*)?", line)
        if match and match.group(1) not in {"python", "pip"}:
            conda_side[match.group(1).lower()] = match.group(2) or ""
    assert conda_side == pip_side, (
        "environment.yml and lib/pyproject.toml disagree: "
        f"only in environment.yml {sorted(set(conda_side) - set(pip_side))}, "
        f"only in pyproject {sorted(set(pip_side) - set(conda_side))}, "
        f"different bounds {sorted(k for k in set(conda_side) & set(pip_side) if conda_side[k] != pip_side[k])}"
    )
