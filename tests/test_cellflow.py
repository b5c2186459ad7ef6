"""Which lab cells the suite runs (ddlab.tools.cellflow): exercises, checks, what they read, and every cell
that may read an exercise's result; never fewer."""

from __future__ import annotations

import nbformat
from ddlab.tools.cellflow import cell_names, cells_the_lab_runs, untagged_uses

START = "from ddlab.runtime import cluster\nrc = cluster.start(n=4)"
EXERCISE = (
    "%%px\n# Exercise 1.1: double\ndef double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"
)


def notebook(*cells: tuple[str, list[str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for source, tags in cells:
        cell = nbformat.v4.new_code_cell(source)
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)
    return nb


def test_names_are_read_in_order_and_per_namespace():
    names = cell_names("%%px\nfor x in range(3):\n    y = x + z\nw = y\nw += 1")
    assert names.defines == {"engines:x", "engines:y", "engines:w"}
    assert names.uses == {"engines:range", "engines:z"}  # x, y and w are the cell's own
    pulled = cell_names('runs = rc[0].pull("runs")\nprint(runs)')
    assert pulled.uses == {"kernel:rc", "kernel:print", "engines:runs", "kernel:runs"}
    assert cell_names('rc[:].push({"f": g})').defines == {"engines:f"}
    both = cell_names('a, b = rc[0].pull(["sizes", "seconds"])')
    assert {"engines:sizes", "engines:seconds"} <= both.uses
    assert cell_names("from x import *").opaque and cell_names("def (:").opaque


def test_a_cell_reading_an_exercise_result_is_named_unless_tagged():
    nb = notebook(
        (START, []),
        (EXERCISE, []),
        ("%%px\nfrom ddlab import checks\nchecks.check_double(double)", ["check"]),
        ("%%px\nfour = double(2)", []),  # reads the answer, untagged: reported
        ("%%px\nsix = double(3)", ["needs-solution"]),
        ("%%px\nprint(six)", []),  # reads a needs-solution cell's result
        ("%%px\nseven = 7\nprint(seven)", []),
        ("%%px\nlater = lambda: double(4)", []),  # made from the answer: what it binds is too
        ("%%px\nlater()", []),
        ("cluster.stop()", []),
    )
    assert untagged_uses(nb) == [
        (3, ["engines:double"]),
        (5, ["engines:six"]),
        (7, ["engines:double"]),
        (8, ["engines:later"]),
    ]
    runs = cells_the_lab_runs(nb)
    # the start and stop, the exercise, its check, the cells reported and what they read; not cell 6
    assert runs == {0, 1, 2, 3, 4, 5, 7, 8, 9}


def test_what_a_needed_cell_reads_runs_too():
    nb = notebook(
        (START, []),
        ("%%px\nimport numpy as np\nsizes = [1, 2]", []),
        ("%%px\nunused = np.zeros(3)", []),
        (EXERCISE, []),
        ("%%px\nchecks.check_double(double, sizes)", ["check"]),
        ("rc = cluster.restart()", []),  # changes the engines: always runs
        ("cluster.stop()", []),
    )
    assert cells_the_lab_runs(nb) == {0, 1, 3, 4, 5, 6}
