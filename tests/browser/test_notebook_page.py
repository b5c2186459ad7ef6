"""The page reader's verdicts on made-up pages: it must catch each thing a student should not see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from notebook_page import ENGINES_DOWN, Cell, drawing_cells, student_view_problems

NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "metadata": {},
            "source": "import ddlab.plots\n\ndef show(x):\n    ddlab.plots.data_movement(x, x, '')",
        },
        {"cell_type": "code", "metadata": {}, "source": "show(1)"},
        {"cell_type": "code", "metadata": {"tags": ["check"]}, "source": "%%px\nddlab.checks.check_x(x)"},
        {"cell_type": "code", "metadata": {"tags": ["raises-exception"]}, "source": "%%px --targets 3\nos._exit(1)"},
        {"cell_type": "code", "metadata": {}, "source": "print(1)"},
    ],
}


def out(
    text: str, mime: str = "application/vnd.jupyter.stdout", images: int = 0, widgets: int = 0, alts: tuple = ()
) -> dict:
    return {"mime": mime, "text": text, "images": images, "widgets": widgets, "alts": list(alts)}


STDERR = "application/vnd.jupyter.stderr"


def page(**changes: list[dict]) -> list[Cell]:
    """The page of a good run of NOTEBOOK, with some cells' outputs replaced."""
    outputs = {
        0: [],
        1: [out("", "text/html", images=1, alts=["Bcast: every rank gets the root's array"])],
        2: [out("[stdout:0] passed: all ranks agree")],
        3: [out("[Engine Exception]", STDERR), out("Only 3 of 4 engines are up: an engine crashed", STDERR)],
        4: [out("1\n")],
    }
    for key, value in changes.items():
        outputs[int(key[1:])] = value
    cells = NOTEBOOK["cells"]
    return [
        Cell(i, c["source"], c["metadata"].get("tags", []), True, f"[{i + 1}]:", outputs[i])
        for i, c in enumerate(cells)
    ]


@pytest.fixture
def notebook(tmp_path: Path) -> Path:
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(NOTEBOOK))
    return path


def test_a_good_page_passes(notebook: Path) -> None:
    assert drawing_cells(notebook) == {1}  # through the notebook's own `show`
    assert student_view_problems(page(), notebook, in_lab=False) == []


@pytest.mark.parametrize(
    "changes,complaint",
    [
        ({"c1": [out("<Figure size 640x480 with 1 Axes>", "text/plain")]}, "draws a figure but shows no image"),
        ({"c1": [out("", "image/png", images=1, alts=[""])]}, "an image without a text alternative"),
        ({"c2": [out("[stdout:0] all good")]}, "no 'passed:' line"),
        ({"c4": [out("1\n"), out("Traceback ... ValueError", STDERR)]}, "shows error output"),
        ({"c4": [out("Only 3 of 4 engines are up: an engine crashed", STDERR)]}, "shows error output"),
        ({"c4": [out("2026-01-31 12:00:00.123 [IPEngine.0] Registering", "text/plain")]}, "log line"),
        ({"c4": [out("train:  40%|████      | 4/10 [00:01<00:02,  3.1it/s]", STDERR)]}, "a progress bar"),
        ({"c4": [out("", "application/vnd.jupyter.widget-view+json", widgets=1)]}, "a widget"),
    ],
)
def test_each_problem_is_caught(notebook: Path, changes: dict, complaint: str) -> None:
    problems = student_view_problems(page(**changes), notebook, in_lab=False)
    assert any(complaint in p for p in problems), problems


def test_unrun_cells_and_lab_checks(notebook: Path) -> None:
    cells = page()
    cells[4].prompt = "[ ]:"
    assert any("did not run" in p for p in student_view_problems(cells, notebook, in_lab=False))
    # In labs/, a check must fail on the stub: a passing check is a problem, the stub's error is not.
    assert any("must fail on the exercise stub" in p for p in student_view_problems(page(), notebook, in_lab=True))
    stub = page(c2=[out("NotImplementedError: Exercise 2.1 (x) is not done yet", STDERR)])
    stub[2].tags = ["check", "raises-exception"]  # as labgen tags the checks of labs/
    assert student_view_problems(stub, notebook, in_lab=True, notices=(ENGINES_DOWN,)) == []
