"""The lab generator: stubs, check tags, and refusal of malformed solution notebooks."""

from __future__ import annotations

import nbformat
import pytest
from ddlab.tools.labgen import LabSourceError, checks, make_lab, stub_source


def notebook(*cells: tuple[str, str, list[str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for kind, source, tags in cells:
        cell = nbformat.v4.new_code_cell(source) if kind == "code" else nbformat.v4.new_markdown_cell(source)
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)
    return nb


EXERCISE = """%%px
# Exercise 2.1: bcast_linear
def bcast_linear(comm, x, root=0):
    size = comm
    ### BEGIN SOLUTION
    secret = 42
    return secret
    ### END SOLUTION
"""


def test_stub_replaces_the_solution_and_names_the_exercise():
    source, stubs = stub_source(EXERCISE, "cell")
    assert stubs == 1
    assert "secret" not in source and "BEGIN SOLUTION" not in source
    assert "    raise NotImplementedError('Exercise 2.1 (bcast_linear)" in source
    assert source.startswith("%%px\n# Exercise 2.1: bcast_linear\ndef bcast_linear")
    namespace: dict = {}
    exec(source.split("\n", 1)[1], namespace)  # the stub is valid Python
    with pytest.raises(NotImplementedError, match="Exercise 2.1"):
        namespace["bcast_linear"](None, None)


def test_checks_become_must_raise_and_outputs_go():
    nb = notebook(
        ("code", EXERCISE, []),
        ("code", "check(bcast_linear)", ["check"]),
        ("code", "plot(bcast_linear)", ["needs-solution"]),
        ("code", "print(1)", []),
    )
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells[3].execution_count = 3
    lab = make_lab(nb)
    assert lab.cells[1].metadata.tags == ["check", "raises-exception"]
    assert lab.cells[2].metadata.tags == ["needs-solution", "raises-exception"]
    assert "tags" not in lab.cells[3].metadata
    assert lab.cells[3].outputs == [] and lab.cells[3].execution_count is None
    assert nb.cells[3].outputs, "the solution notebook itself is left alone"


@pytest.mark.parametrize(
    "source, problem",
    [
        ("# Exercise 1.1: x\n### BEGIN SOLUTION\npass\n", "never closed"),
        ("# Exercise 1.1: x\n### END SOLUTION\n", "without"),
        ("### BEGIN SOLUTION\npass\n### END SOLUTION\n", "Exercise N.M"),
        ("# Exercise 1.1: x\n### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside"),
    ],
)
def test_malformed_blocks_are_refused(source, problem):
    with pytest.raises(LabSourceError, match=problem):
        stub_source(source, "cell")


def test_a_check_before_any_exercise_is_refused():
    with pytest.raises(LabSourceError, match="checks nothing"):
        make_lab(notebook(("code", "check(f)", ["check"]), ("code", EXERCISE, [])))


def test_nbgrader_metadata_with_stable_grade_ids():
    nb = notebook(
        ("code", EXERCISE, []),
        ("code", "check(bcast_linear)", ["check"]),
        ("code", "check_again(bcast_linear)", ["check"]),
        ("code", "print(1)", []),
    )
    lab = make_lab(nb)
    solution, check, again = (lab.cells[i].metadata.nbgrader for i in range(3))
    assert solution == {
        "grade": False,
        "grade_id": "ex2_1_bcast_linear",
        "locked": False,
        "schema_version": 3,
        "solution": True,
        "task": False,
    }
    assert check == {
        "grade": True,
        "grade_id": "check_ex2_1_bcast_linear",
        "locked": True,
        "points": 1,
        "schema_version": 3,
        "solution": False,
        "task": False,
    }
    assert again.grade_id == "check_ex2_1_bcast_linear_2"
    assert "nbgrader" not in lab.cells[3].metadata
    assert make_lab(nb) == lab, "the same solution gives the same ids"
    found = checks(lab)
    assert [(c.index, c.grade_id, c.exercise, c.function, c.points) for c in found] == [
        (1, "check_ex2_1_bcast_linear", "Exercise 2.1", "bcast_linear", 1),
        (2, "check_ex2_1_bcast_linear_2", "Exercise 2.1", "bcast_linear", 1),
    ]
