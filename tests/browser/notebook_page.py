"""Drive JupyterLab in a browser as a student does, and read back what the page shows.

`NotebookPage` opens a notebook, picks its kernel, runs all cells from the Run menu, types
new cells, interrupts from the toolbar; `cells()` returns every cell as rendered (prompt,
each output's type and text, images). `student_view_problems` says what in those cells a
student should not see. Used by test_jupyterlab.py and test_jupyterhub.py.
"""

from __future__ import annotations

import ast
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Playwright is installed by the tests' set-up, not needed to import this
    from playwright.sync_api import Page

KERNEL = "Python (ddlab)"
#: The check harness's line on success (ddlab.checks._core.passed), as %%px shows it or not.
PASSED = re.compile(r"^(\[stdout:\d+\] )?passed: ", re.MULTILINE)
#: What must never reach a student: ipyparallel / engine log lines, progress bars.
NOISE = {
    "an engine or controller log line": re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[", re.MULTILINE),
    "a progress bar": re.compile(r"\d+%\|[^|\n]*\||\d+it/s|it \[\d\d:\d\d"),
    "a figure shown as text instead of an image": re.compile(r"<Figure size \d+x\d+ with \d+ Axes>"),
}
#: ddlab.runtime.cluster's notice after a cell when engines are gone (lab 00 provokes it on purpose).
ENGINES_DOWN = re.compile(r"^Only \d+ of \d+ engines are up: an engine crashed")

_READ_CELLS = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell'))
  .map(cell => ({
    code: cell.classList.contains('jp-CodeCell'),
    prompt: (cell.querySelector('.jp-InputArea-prompt') || {innerText: ''}).innerText.trim(),
    outputs: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(out => ({
      mime: out.getAttribute('data-mime-type') || '',
      text: out.innerText,
      images: out.querySelectorAll('img').length,
      alts: Array.from(out.querySelectorAll('img')).map(img => img.getAttribute('alt') || ''),
      widgets: out.querySelectorAll('.jupyter-widgets, .widget-html, progress').length,
    })),
  }))"""


@dataclass
class Cell:
    """One notebook cell as the page shows it, with its source and tags from the file."""

    index: int
    source: str
    tags: list[str]
    code: bool
    prompt: str
    outputs: list[dict] = field(default_factory=list)

    def text(self, mime_prefix: str = "") -> str:
        return "\n".join(o["text"] for o in self.outputs if o["mime"].startswith(mime_prefix))

    @property
    def stderr(self) -> list[str]:
        """Error tracebacks and stderr streams (JupyterLab renders both as this type)."""
        return [o["text"] for o in self.outputs if o["mime"] == "application/vnd.jupyter.stderr"]

    @property
    def images(self) -> int:
        return sum(o["images"] for o in self.outputs)

    def __str__(self) -> str:
        outputs = "\n".join(f"  <{o['mime']}> {o['text'][:1500]}" for o in self.outputs)
        return f"cell {self.index} {self.prompt} {self.tags}\n{self.source[:300]}\n{outputs}"


class NotebookPage:
    """A JupyterLab page with one notebook open."""

    def __init__(self, page: Page, lab_url: str) -> None:
        self.page = page
        self.lab_url = lab_url.rstrip("/")  # e.g. http://127.0.0.1:8888/lab or .../user/student/lab

    def open(self, path: str, timeout: float = 120) -> None:
        """Open the notebook at `path` (relative to the server's root folder) in its own tab."""
        self.path = path
        # ?reset: a fresh layout, not the tabs an earlier visit left open
        self.page.goto(f"{self.lab_url}/tree/{path}?reset", timeout=timeout * 1000)
        self.page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout * 1000)
        tabs = self.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab")
        assert tabs.count() == 1, f"expected only {path} open, the tabs are {tabs.all_inner_texts()}"

    def pick_kernel(self, name: str = KERNEL, timeout: float = 120) -> None:
        """Click the kernel name in the notebook's toolbar and choose `name` in the dialog."""
        toolbar_name = self.page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName")
        dialog = self.page.locator(".jp-Dialog")
        if not dialog.is_visible():  # the notebook asks by itself when its kernel is unknown
            toolbar_name.click()
        dialog.locator("select").select_option(label=name)
        dialog.locator("button.jp-mod-accept").click()
        self.page.wait_for_function(
            """name => { const k = document.querySelector('.jp-NotebookPanel-toolbar .jp-Toolbar-kernelName');
                         return k && k.innerText.trim() === name; }""",
            arg=name,
            timeout=timeout * 1000,
        )
        self.wait_until_idle(timeout)

    def wait_until_idle(self, timeout: float) -> None:
        """Wait until the kernel is idle and no cell is queued or running ([*])."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.page.evaluate(
                """() => { const i = document.querySelector('.jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator');
                           const prompts = Array.from(document.querySelectorAll('.jp-Notebook .jp-InputArea-prompt'));
                           return [i ? i.getAttribute('data-status') : '', prompts.some(p => p.innerText.includes('*'))]; }"""
            )
            if state == ["idle", False]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: still busy after {timeout:.0f} s (kernel {state[0]!r})")
            time.sleep(0.5)

    def menu(self, *items: str) -> None:
        """Click through the menu bar, e.g. menu("Run", "Run All Cells")."""
        self.page.get_by_role("menuitem", name=items[0], exact=True).click()
        for item in items[1:]:
            self.page.locator(".lm-Menu").get_by_role("menuitem", name=item, exact=True).click()

    def run_all(self, timeout: float) -> None:
        """Run > Run All Cells, then wait for the last cell."""
        self.menu("Run", "Run All Cells")
        self.page.wait_for_function(  # the run has started: the first code cell is queued or done
            "() => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt'))"
            ".some(p => /\\[[0-9*]+\\]/.test(p.innerText))",
            timeout=30_000,
        )
        self.wait_until_idle(timeout)

    def add_cell(self, code: str) -> None:
        """Append a code cell after the last one (command mode `b`) and type `code` into it."""
        last = self.page.locator(".jp-Notebook .jp-Cell").last
        last.locator(".jp-InputPrompt").click()  # select the cell (command mode)
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("b")
        self.page.locator(".jp-Notebook .jp-Cell").last.locator(".cm-content").click()
        if code:
            self.page.keyboard.insert_text(code)  # no auto-indent, as if pasted

    def shut_down_kernel(self, timeout: float = 60) -> None:
        """Kernel > Shut Down Kernel, and wait until the toolbar says so."""
        self.menu("Kernel", "Shut Down Kernel")
        self.page.wait_for_function(
            """() => { const k = document.querySelector('.jp-NotebookPanel-toolbar .jp-Toolbar-kernelName');
                       return k && k.innerText.trim() === 'No Kernel'; }""",
            timeout=timeout * 1000,
        )

    def run_cell(self) -> None:
        """Shift+Enter in the cell being edited."""
        self.page.keyboard.press("Shift+Enter")

    def interrupt(self) -> None:
        """The toolbar's stop button (Interrupt the kernel)."""
        self.page.locator('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]').click()

    def cells(self, notebook: Path | None = None) -> list[Cell]:
        """Every cell as rendered, with sources and tags from `notebook` (the file it was opened from)."""
        shown = self.page.evaluate(_READ_CELLS)
        sources = json.loads(notebook.read_text())["cells"] if notebook else []
        cells = []
        for i, cell in enumerate(shown):
            meta = sources[i] if i < len(sources) else {"source": "", "metadata": {}}
            source = "".join(meta["source"]) if isinstance(meta["source"], list) else meta["source"]
            cells.append(
                Cell(i, source, meta["metadata"].get("tags", []), cell["code"], cell["prompt"], cell["outputs"])
            )
        return cells

    def screenshot(self, path: Path) -> None:
        """The page as it is, and every cell's text next to it (the notebook scrolls inside the page)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path))
        path.with_suffix(".txt").write_text("\n\n".join(str(c) for c in self.cells()))


def drawing_cells(notebook: Path) -> set[int]:
    """Indices of the notebook-side code cells that draw a figure.

    A cell draws when it calls a function of `ddlab.plots` or of a lab's `figures` module,
    or a function defined earlier in the notebook that does (lab 02's `show`). `%%px` cells
    run on the engines, whose figures the page never sees.
    """
    drawers: set[str] = set()
    found = set()
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.lstrip().startswith("%%"):
            continue
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _draws(node, drawers):
                    drawers.add(node.name)
            elif _draws(node, drawers):
                found.add(i)
    return found


def _draws(node: ast.AST, drawers: set[str]) -> bool:
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Name) and func.id in drawers:
            return True
        if isinstance(func, ast.Attribute):
            owner = func.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if owner_name in ("plots", "figures"):
                return True
    return False


def student_view_problems(
    cells: list[Cell], notebook: Path, in_lab: bool, notices: tuple[re.Pattern, ...] = ()
) -> list[str]:
    """What in the rendered cells a student should not see, or misses; empty when all is well.

    - every code cell ran (a number in its prompt);
    - errors and stderr only in cells tagged raises-exception, besides the `notices` expected;
    - in labs/, every check cell fails on the exercise stub (NotImplementedError); in
      solutions/, every check cell prints its `passed:` line;
    - every cell that draws shows an image, and every image its text alternative (`<img alt>`, from
      ddlab.plots.alt's text/html); no log lines, progress bars or widgets anywhere.
    """
    problems = []
    expected_cells = len(json.loads(notebook.read_text())["cells"])
    if len(cells) != expected_cells:
        problems.append(f"the page shows {len(cells)} cells, the notebook has {expected_cells}")
    draws = drawing_cells(notebook)
    for cell in cells:
        if not cell.code:
            continue
        where = f"cell {cell.index} ({cell.source.splitlines()[0][:60] if cell.source else ''!r})"
        if not re.fullmatch(r"\[\d+\]:", cell.prompt):
            problems.append(f"{where} did not run: prompt {cell.prompt!r}")
        may_fail = "raises-exception" in cell.tags
        unexpected = [t for t in cell.stderr if not any(n.match(t) for n in notices)]
        if unexpected and not may_fail:
            problems.append(f"{where} shows error output:\n{unexpected[0][-1500:]}")
        if "check" in cell.tags:
            if in_lab and "NotImplementedError" not in "\n".join(cell.stderr):
                problems.append(f"{where}: this check must fail on the exercise stub, it shows:\n{cell.text()[-800:]}")
            if not in_lab and not PASSED.search(cell.text()):
                problems.append(f"{where}: no 'passed:' line; it shows:\n{cell.text()[-1500:]}")
        if cell.index in draws and not (in_lab and "needs-solution" in cell.tags) and cell.images == 0:
            problems.append(f"{where} draws a figure but shows no image; it shows:\n{cell.text()[-800:]}")
        if any(not alt.strip() for o in cell.outputs for alt in o.get("alts", [])):
            problems.append(f"{where} shows an image without a text alternative (no alt): pass alt= to its figure")
        for what, pattern in NOISE.items():
            if pattern.search(cell.text()):
                problems.append(f"{where} shows {what}:\n{cell.text()[-800:]}")
        if any(o["widgets"] for o in cell.outputs):
            problems.append(f"{where} shows a widget (a progress bar?)")
    return problems
