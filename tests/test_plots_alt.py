"""Every figure carries a text alternative (ddlab.plots.alt), and every figure a lab draws passes one.

The library's figure functions take `alt` as a required keyword and return a figure that IPython
displays once with it: text/plain (text front ends), the PNG with `alt` in its metadata, and an
`<img alt>` in text/html (what JupyterLab renders). The lab notebooks pass an `alt` to every figure
function they call and show the figures they draw with matplotlib through `ddlab.plots.show`: a
static reading of solutions/ finds every cell that draws and fails on the first that passes none.
"""

from __future__ import annotations

import ast
import functools
import html
import importlib
import inspect
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import ddlab  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from ddlab import plots  # noqa: E402
from ddlab.runtime.trace import Span  # noqa: E402
from IPython.core.inputtransformer2 import TransformerManager  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.display import display  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ALT = "Two ranks' values against the step: rank 1 doubles rank 0 at every step"


def shown(draw) -> tuple[dict, dict]:
    """(data, metadata) of the one output that displaying what `draw()` returns gives in IPython."""
    InteractiveShell.instance()
    with capture_output() as captured:
        draw()
    assert len(captured.outputs) == 1, f"{len(captured.outputs)} outputs, not one"
    return captured.outputs[0].data, captured.outputs[0].metadata


def assert_carries(data: dict, metadata: dict, alt: str) -> None:
    assert data["text/plain"] == alt
    assert metadata == {"image/png": {"alt": alt}}
    assert data["image/png"] and f'alt="{html.escape(alt)}"' in data["text/html"]
    assert data["text/html"].startswith(f'<img src="data:image/png;base64,{data["image/png"]}"')


def line_figure() -> plots.Described:
    fig, ax = plots.subplots()
    ax.plot([0, 1, 2], [1, 2, 4], label="rank 0")
    ax.plot([0, 1, 2], [2, 4, 8], label="rank 1")
    ax.set(xlabel="step", ylabel="value", yscale="log", title="values")
    ax.legend()
    return plots.describe(fig, ALT)


def test_a_figure_displays_once_with_its_alt_then_what_its_axes_say():
    fig = line_figure()
    assert fig.alt == ALT + " Panel 'values': x: step; y: value (log scale); key: rank 0, rank 1."
    data, metadata = shown(lambda: display(fig))
    assert_carries(data, metadata, fig.alt)
    assert fig.number not in plt.get_fignums()  # closed: pyplot's inline backend does not show it again


def test_show_gives_a_pyplot_figure_a_lab_draws_the_same_bundle():
    fig, ax = plt.subplots()
    ax.bar(["GPipe", "1F1B"], [16, 4])
    ax.set_ylabel("micro-batches held")
    data, metadata = shown(lambda: plots.show(fig, alt="Micro-batches rank 0 holds: GPipe 16, 1F1B 4"))
    assert_carries(data, metadata, "Micro-batches rank 0 holds: GPipe 16, 1F1B 4 Axes: y: micro-batches held.")
    assert fig.number not in plt.get_fignums()


@pytest.mark.parametrize("alt", [None, "", "   ", "a figure", 42])
def test_an_alt_that_cannot_say_what_a_figure_shows_is_refused(alt):
    fig, _ = plots.subplots()
    with pytest.raises(ValueError, match="text alternative of 20"):
        plots.describe(fig, alt)
    with pytest.raises(ValueError, match="text alternative of 20"):
        plots.show(fig, alt)
    plt.close("all")


def test_a_figure_without_its_alt_is_neither_described_nor_displayed():
    with pytest.raises(TypeError, match="ddlab.plots.subplots"):
        plots.describe(plt.figure(), ALT)
    fig, _ = plots.subplots()
    InteractiveShell.instance()
    with capture_output() as captured:  # IPython prints a display hook's error and falls back to the plain repr
        display(fig)
    assert "this figure has no text alternative" in captured.stdout
    assert all("text/html" not in output.data for output in captured.outputs)
    plt.close("all")


def spans() -> list[list[Span]]:
    return [
        [Span("forward", 0.0, 0.001, number=0), Span("backward", 0.001, 0.003, number=0)],
        [Span("forward", 0.001, 0.002, number=0), Span("allreduce", 0.002, 0.004, track="comm")],
    ]


HELPERS = {
    "cluster_diagram": lambda alt: plots.cluster_diagram(3, alt=alt),
    "data_movement": lambda alt: plots.data_movement(
        [np.arange(2), np.arange(2) + 10], [np.arange(2)] * 2, "t", alt=alt
    ),
    "time_vs_size": lambda alt: plots.time_vs_size([8, 64], {"bcast": {"linear": [1e-6, 2e-6]}}, alt=alt),
    "gantt": lambda alt: plots.gantt(spans(), "two ranks", alt=alt),
    "gantt_pair": lambda alt: plots.gantt_pair(spans(), spans(), ("busy", "wall"), alt=alt),
    "unet_diagram": lambda alt: plots.unet_diagram(["Conv", "Down0", "Up0", "Head"], [0, 2, 4], alt=alt),
}


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_each_helper_s_figure_carries_its_alt(name):
    fig = HELPERS[name](ALT)
    assert fig.alt.startswith(ALT)
    assert_carries(*shown(lambda: display(fig)), fig.alt)
    if name == "time_vs_size":
        assert "x: array size (log scale); y: time (microseconds) (log scale); key: linear." in fig.alt
    if name == "gantt":
        assert "Panel 'two ranks': x: time (ms); key: forward, backward, allreduce." in fig.alt


@functools.cache
def figure_functions() -> dict[str, object]:
    """Every public function of ddlab.plots' figure modules and of every ddlab.*.figures module."""
    names = [f"ddlab.plots.{m}" for m in ("cluster", "messages", "timelines", "unet")]
    names += [f"ddlab.{p.parent.name}.figures" for p in sorted(Path(ddlab.__file__).parent.glob("*/figures.py"))]
    modules = [importlib.import_module(name) for name in names]
    return {
        f"{module.__name__}.{name}": fn
        for module in modules
        for name, fn in inspect.getmembers(module, inspect.isfunction)
        if not name.startswith("_") and fn.__module__ == module.__name__
    }


def test_every_figure_function_takes_alt_as_a_required_keyword():
    found = figure_functions()
    assert len(found) > 40 and "ddlab.allreduce.figures.exchange_pattern" in found
    missing = [
        name
        for name, fn in found.items()
        if (p := inspect.signature(fn).parameters.get("alt")) is None  # type: ignore[arg-type]
        or p.kind is not inspect.Parameter.KEYWORD_ONLY
        or p.default is not inspect.Parameter.empty
    ]
    assert not missing, f"figure functions without a required keyword alt: {missing}"


# The static reading of the labs.

#: What draws a figure in a lab cell: a call of pyplot (plt.subplots, plt.plot, ...).
PYPLOT = ("plt.", "matplotlib.pyplot.")


def _python(source: str) -> str:
    """A cell's Python: IPython's syntax (magics, %%px's body) made Python; other cell magics give nothing."""
    if source.lstrip().startswith("%%"):
        first, _, rest = source.lstrip().partition("\n")
        if not first.startswith("%%px"):
            return ""
        source = rest
    return TransformerManager().transform_cell(source)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def figures_without_alt(cells: list[str], figure_names: set[str]) -> list[str]:
    """What in these cells (in order, one notebook) draws or shows a figure without a text alternative.

    A figure call is a call of a `figure_names` function (ddlab.plots.X, ddlab.<topic>.figures.X, or X
    imported from them) or of ddlab.plots.show; each must pass `alt`. A cell that calls pyplot must show
    its figure with ddlab.plots.show and never with plt.show.
    """
    imported: set[str] = set()
    problems = []
    for index, source in enumerate(cells):
        tree = ast.parse(_python(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddlab"):
                if node.module == "ddlab.plots" or node.module.endswith(".figures"):
                    imported |= {alias.asname or alias.name for alias in node.names}
        calls = [(n, _dotted(n.func)) for n in ast.walk(tree) if isinstance(n, ast.Call)]
        pyplot = False
        for call, name in calls:
            if name is None:
                continue
            last = name.rsplit(".", 1)[-1]
            library = (name.startswith("ddlab.plots.") or ".figures." in name) and last in figure_names | {"show"}
            if library or name in imported:
                if not any(k.arg == "alt" for k in call.keywords):
                    problems.append(f"cell {index}: {name}(...) passes no alt")
            elif name.startswith(PYPLOT):
                pyplot = True
                if name.endswith(".show"):
                    problems.append(
                        f"cell {index}: {name}() shows a figure without its alt: use ddlab.plots.show(fig, alt=...)"
                    )
        if pyplot and not any(name and name.rsplit(".", 1)[-1] == "show" and name != "plt.show" for _, name in calls):
            problems.append(
                f"cell {index} draws with pyplot but never shows its figure with ddlab.plots.show(fig, alt=...)"
            )
    return problems


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_every_figure_a_lab_draws_passes_a_text_alternative():
    names = {name.rsplit(".", 1)[-1] for name in figure_functions()}
    notebooks = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    assert len(notebooks) >= 20
    problems = [f"{path.name} {p}" for path in notebooks for p in figures_without_alt(code_cells(path), names)]
    assert not problems, "\n".join(problems)
    drawing = sum("alt=" in cell for path in notebooks for cell in code_cells(path))
    assert drawing >= 60, f"only {drawing} cells pass an alt: is the reading finding the labs' figures?"


@pytest.mark.parametrize(
    "cells, problem",
    [
        (["import ddlab.plots\nddlab.plots.gantt(spans, 'steps');"], "cell 0: ddlab.plots.gantt(...) passes no alt"),
        (
            ["x = 1", "ddlab.allreduce.figures.ring_allreduce_steps(4)"],
            "cell 1: ddlab.allreduce.figures.ring_allreduce_steps",
        ),
        (
            ["from ddlab.oracle.figures import plot_published\nplot_published(rows);"],
            "plot_published(...) passes no alt",
        ),
        (["from ddlab.plots import gantt as g", "g(spans, 'steps');"], "cell 1: g(...) passes no alt"),
        (["fig, ax = plt.subplots()\nax.plot([1, 2])\nplt.show()"], "plt.show() shows a figure without its alt"),
        (["fig, ax = plt.subplots()\nax.plot([1, 2])"], "draws with pyplot but never shows"),
        (["fig, ax = plt.subplots()\nddlab.plots.show(fig)"], "ddlab.plots.show(...) passes no alt"),
        (["%%px\nfig, ax = plt.subplots()\nplt.show()"], "cell 0: plt.show()"),
    ],
)
def test_the_reading_finds_a_figure_without_its_alt(cells, problem):
    names = {name.rsplit(".", 1)[-1] for name in figure_functions()}
    found = figures_without_alt(cells, names)
    assert any(problem in p for p in found), found


def test_the_reading_passes_figures_with_their_alt_and_calls_that_draw_nothing():
    names = {name.rsplit(".", 1)[-1] for name in figure_functions()}
    cells = [
        "from ddlab.plots import gantt\ngantt(spans, 'steps', alt=f'{len(spans)} ranks: forward, then backward')",
        "fig, ax = plt.subplots()\nax.plot([1, 2])\nddlab.plots.show(fig, alt='a line from 1 to 2 over 2 steps')",
        "from ddlab.mesh import layouts\nlayouts(4)",  # not a figure: a function of ddlab.mesh with a figure's name
        "%%bash\necho plt.show()",
    ]
    assert figures_without_alt(cells, names) == []


def test_the_labs_fail_the_reading_when_one_figure_loses_its_alt():
    names = {name.rsplit(".", 1)[-1] for name in figure_functions()}
    cells = code_cells(ROOT / "solutions" / "03_allreduce.ipynb")
    index = next(i for i, c in enumerate(cells) if "ring_allreduce_steps(4, alt=" in c)
    cells[index] = "ddlab.allreduce.figures.ring_allreduce_steps(4);"
    assert figures_without_alt(cells, names) == [
        f"cell {index}: ddlab.allreduce.figures.ring_allreduce_steps(...) passes no alt"
    ]
