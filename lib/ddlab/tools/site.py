"""The course site: `make site` (python -m ddlab.tools.site OUT) builds it with Sphinx and MyST-NB.

The pages: a home page (who the course is for, a map of the labs and what each builds on,
the time per lab from docs/teaching.md, how to run it), one page per lab from `labs/` (the
students' version: its text, equations and stubs, never `solutions/`), the docs/ pages and
CONTRIBUTING.md, and Sphinx's search. Every lab page links to open that lab on the class's
JupyterHub through nbgitpuller; the hub, the repository it pulls and the branch are set once
in docs/site/config.ini (or on the command line).

Figures: the labs are committed without outputs, and most of their figures draw what the
engines measured. The site shows the figures the library draws from the lab's own literal
arguments (a cell that is one call of a `figures` or `plots` function, such as
`ddlab.allreduce.figures.exchange_pattern(4, "rabenseifner", alt=...)`): they are drawn here at
build time by that call, with the text alternative it gives (`ddlab.plots.alt`), and stand where
the lab's output would. A figure of measured data appears when the student runs the lab.

    .venv/bin/python -m ddlab.tools.site build/site            # writes build/site/html/index.html
"""

from __future__ import annotations

import argparse
import ast
import configparser
import copy
import importlib
import re
import shutil
import subprocess
import sys
import urllib.parse
from base64 import b64encode
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import nbformat

from ..runtime.cluster import CLUSTERS_DIR

REPO = CLUSTERS_DIR.parent
CONFIG = REPO / "docs" / "site" / "config.ini"
#: Okabe and Ito's colours, told apart with every common colour-vision deficiency.
OKABE_ITO = ("#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442", "#000000")
_HEADING = re.compile(r"^#\s+(.*)$", re.M)
_TIME = re.compile(r"\*\*Time:\*\*\s*about\s*(\d+)\s*minutes", re.I)
_PREREQ = re.compile(r"\*\*Prerequisites:\*\*(.*?)(?:\*\*Time|\n\n|$)", re.S)
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


@dataclass
class Settings:
    """What docs/site/config.ini sets: the class's hub and the repository it pulls the course from."""

    title: str
    hub: str  # the JupyterHub's address, https://hub.example.edu (no trailing slash)
    repository: str  # the git URL the hub's nbgitpuller clones
    branch: str
    folder: str  # the folder the clone lands in, in each student's home
    web: str  # where a reader browses the repository's files (links to code go there)


def load_settings(path: Path = CONFIG, **overrides: str | None) -> Settings:
    """The site's settings from `path`, with any override given (not None) put in."""
    parser = configparser.ConfigParser(interpolation=None)
    if not parser.read(path) or not parser.has_section("site"):
        raise SystemExit(f"ddlab site: no [site] section in {path}; copy the repository's docs/site/config.ini")
    values: dict[str, str] = dict(parser["site"])
    values.update({k: v for k, v in overrides.items() if v is not None})
    missing = [f for f in Settings.__dataclass_fields__ if not values.get(f)]
    if missing:
        raise SystemExit(f"ddlab site: {path} does not set {', '.join(missing)}; add them there (see its comments)")
    return Settings(**{f: str(values[f]).rstrip("/") for f in Settings.__dataclass_fields__})


def launch_url(settings: Settings, lab: str) -> str:
    """The nbgitpuller link that pulls the course into the student's home and opens `lab` in JupyterLab."""
    query = urllib.parse.urlencode(
        {
            "repo": settings.repository,
            "branch": settings.branch,
            "targetPath": settings.folder,
            "urlpath": f"lab/tree/{settings.folder}/labs/{lab}",
        }
    )
    return f"{settings.hub}/hub/user-redirect/git-pull?{query}"


@dataclass
class Lab:
    number: str
    name: str  # 03_allreduce
    title: str  # "Allreduce by hand"
    minutes: int | None
    needs: list[str]  # the lab numbers its prerequisites name


def _numbers(text: str) -> list[str]:
    """Lab numbers in a prerequisites sentence: "labs 01-02", "lab 03", "labs 04, 07 and 13"."""
    found: set[int] = set()
    for first, last in re.findall(r"\b(\d{2})\s*[-–]\s*(\d{2})\b", text):
        found.update(range(int(first), int(last) + 1))
    found.update(int(n) for n in re.findall(r"\b(\d{2})\b", text))
    return [f"{n:02d}" for n in sorted(found)]


def teaching_minutes(teaching: Path) -> dict[str, int]:
    """Minutes per lab from docs/teaching.md's table "How long each lab takes" (its last column, the first cell's)."""
    text = teaching.read_text()
    section = text.split("## How long each lab takes", 1)[-1].split("\n## ", 1)[0]
    minutes = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and re.fullmatch(r"\d{2}", cells[0]):
            match = re.match(r"(\d+)", cells[-1])
            if match:
                minutes[cells[0]] = int(match.group(1))
    return minutes


def labs(folder: Path, teaching: Path) -> list[Lab]:
    """Every lab notebook in `folder` with its title, time (teaching.md, else its Time line) and prerequisites."""
    minutes, found = teaching_minutes(teaching), []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        first = nbformat.read(path, as_version=4).cells[0].source
        heading = _HEADING.search(first)
        title = heading.group(1).strip() if heading else path.stem
        title = re.sub(r"^Lab\s+\d+\s*[—:-]+\s*", "", title)
        number = path.name[:2]
        prereq = _PREREQ.search(first)
        needs = [n for n in _numbers(prereq.group(1)) if n < number] if prereq else []
        time = _TIME.search(first)
        found.append(Lab(number, path.stem, title, minutes.get(number, int(time.group(1)) if time else None), needs))
    return found


def _figure_call(source: str) -> tuple[str, list, dict] | None:
    """(function path, args, kwargs) if the cell is one call of a ddlab figure function on literal arguments."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr) or not isinstance(tree.body[0].value, ast.Call):
        return None
    call = tree.body[0].value
    name = ast.unparse(call.func)
    if not name.startswith("ddlab.") or not (".figures." in name or name.startswith("ddlab.plots.")):
        return None
    try:
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    except ValueError:
        return None
    return name, args, kwargs


def draw_figure(name: str, args: list, kwargs: dict) -> tuple[bytes, str]:
    """Call the library's figure function as the lab calls it (with its `alt`); its PNG and text alternative."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import Described

    module, function = name.rsplit(".", 1)
    figure = getattr(importlib.import_module(module), function)(*args, **kwargs)
    if not isinstance(figure, Described) or not figure.alt:
        raise SystemExit(f"ddlab site: {name} returned a figure without a text alternative (ddlab.plots.describe)")
    buffer = BytesIO()
    figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue(), figure.alt


def _rewrite_links(text: str, here: str, settings: Settings, pages: set[str]) -> str:
    """Links of a page at `here` (a folder of the repository): to pages kept, else to the repository's web view."""

    def fix(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z]+:|^#", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = Path(here, path).as_posix()
        parts: list[str] = []
        for part in resolved.split("/"):
            if part == "..":
                parts.pop() if parts else None
            elif part not in ("", "."):
                parts.append(part)
        repo_path = "/".join(parts)
        if repo_path.startswith("solutions/"):  # the site has the labs only
            repo_path = "labs/" + repo_path.split("/", 1)[1]
        repo_path = {"README.md": "index.md", "CONTRIBUTING.md": "contributing.md"}.get(repo_path, repo_path)
        if repo_path in pages:
            depth = len(Path(here).parts) if here not in ("", ".") else 0
            new = "../" * depth + repo_path + (f"#{anchor}" if anchor else "")
        else:
            new = f"{settings.web}/blob/{settings.branch}/{repo_path}" + (f"#{anchor}" if anchor else "")
        return match.group(1) + new + match.group(3)

    return _LINK.sub(fix, text)


def lab_map(found: list[Lab]) -> tuple[bytes, str]:
    """The labs as boxes in rows of what they build on, arrows from each direct prerequisite; PNG and its alt text.

    An arrow a -> c is left out when another prerequisite of c builds on a already; the text
    alternative names every prerequisite the lab states.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import describe, subplots

    level: dict[str, int] = {}
    for lab in found:
        level[lab.number] = 1 + max((level[n] for n in lab.needs if n in level), default=-1)
    rows: dict[int, list[Lab]] = {}
    for lab in found:
        rows.setdefault(level[lab.number], []).append(lab)
    place = {}
    for depth, row in rows.items():
        for i, lab in enumerate(row):
            place[lab.number] = (i - (len(row) - 1) / 2, -depth)
    width = max(len(r) for r in rows.values())
    fig, ax = subplots(figsize=(max(6, 2.1 * width), 1.2 * len(rows) + 0.6))
    ancestors: dict[str, set[str]] = {}
    for lab in found:  # in order: a lab's prerequisites come before it
        ancestors[lab.number] = set(lab.needs).union(*(ancestors.get(n, set()) for n in lab.needs))
    for lab in found:
        for need in lab.needs:  # an arrow only from a prerequisite no other prerequisite builds on
            if need in place and not any(need in ancestors.get(other, set()) for other in lab.needs):
                ax.annotate(
                    "",
                    place[lab.number],
                    place[need],
                    arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 0.8, "shrinkA": 11, "shrinkB": 11},
                )
    for lab in found:
        x, y = place[lab.number]
        colour = OKABE_ITO[level[lab.number] % len(OKABE_ITO)]
        ax.text(
            x, y, f"{lab.number}\n{lab.name[3:].replace('_', ' ')}", ha="center", va="center", fontsize=8,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": colour, "lw": 2},
        )  # fmt: skip
    ax.set_xlim(-width / 2 - 0.2, width / 2 + 0.2)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.axis("off")
    edges = "; ".join(
        f"lab {lab.number} builds on "
        + (", ".join(f"lab {n}" for n in lab.needs) if lab.needs else "nothing before it")
        for lab in found
    )
    alt = describe(fig, f"Map of the {len(found)} labs, each below the labs it builds on: {edges}.").alt or ""
    buffer = BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue(), alt


def home_page(found: list[Lab], settings: Settings, map_alt: str) -> str:
    """index.md: who it is for, how to run it, the map and the table of labs, the tables of contents."""
    rows = "\n".join(
        f"| {lab.number} | [{lab.title}](labs/{lab.name}.ipynb) | "
        f"{f'about {lab.minutes} min' if lab.minutes else 'not timed yet'} | "
        f"{', '.join(lab.needs) or '-'} | [open on the hub]({launch_url(settings, lab.name + '.ipynb')}) |"
        for lab in found
    )
    total = sum(lab.minutes or 0 for lab in found)
    return f"""# {settings.title}

ddlab is a course in ordered Jupyter notebooks: students drive a real MPI job of ipyparallel
engines and build distributed training from the ground up, from point-to-point messages and
collectives to a hand-written allreduce, data, model, pipeline, tensor and sequence parallelism.
Every exercise is checked the moment it is written.

**Who it is for.** Students who know Python and NumPy but not MPI (a laptop with 4 cores is
enough), and instructors who run a course on it, on laptops or on a cluster's JupyterHub.

## How to run it

- **On the class's JupyterHub:** the link on each lab's page pulls the course into your home
  folder and opens that lab in JupyterLab.
- **On a laptop** (Linux or macOS, Python 3.10 or newer): clone the repository and run
  `make lab`; it sets everything up the first time and opens JupyterLab on `labs/`.
- **With conda:** `conda env create -f environment.yml` builds the same environment.

## The labs and what each builds on

![{map_alt}](_static/lab_map.png)

| # | lab | time | builds on | launch |
|---|---|---|---|---|
{rows}

About {total} minutes in all (times from [the teaching notes](docs/teaching.md#how-long-each-lab-takes)).
Each lab page shows the students' version: exercises are stubs, and the check after each one
fails until the exercise is done.

```{{toctree}}
:caption: Labs
:maxdepth: 1
:glob:

labs/*
```

```{{toctree}}
:caption: For instructors and contributors
:maxdepth: 1

docs/teaching
docs/hpc
docs/benchmarks
docs/testing
docs/architecture
contributing
```
"""


CONF = """# Written by ddlab.tools.site; edit docs/site/config.ini instead.
project = {title!r}
extensions = ["myst_nb", "sphinx-mathjax-offline"]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 4
nb_execution_mode = "off"
nb_merge_streams = True
html_theme = "alabaster"
html_theme_options = {{"show_relbars": True}}
html_static_path = ["_static"]
html_css_files = ["a11y.css"]
pygments_style = "a11y-high-contrast-light"
html_title = {title!r}
exclude_patterns = ["_build"]
suppress_warnings = ["myst.header", "misc.highlighting_failure"]
"""


#: Colours that keep WCAG AA's contrast (4.5:1) where the theme's do not.
A11Y_CSS = """div.footer, div.footer a { color: #4a4a4a; }
a.headerlink { color: #4a4a4a; }
"""


def accessible(page: str) -> str:
    """A built page made accessible where Sphinx's markup is not: headings by role get their level, and
    scrolling code blocks can be reached with the keyboard."""
    page = re.sub(r'role="heading"(?![^>]*aria-level)', 'role="heading" aria-level="2"', page)
    return re.sub(r"<pre(?![^>]*tabindex)", '<pre tabindex="0"', page)


def stage(source: Path, settings: Settings, repo: Path = REPO, only: Sequence[str] | None = None) -> list[Lab]:
    """Write the Sphinx project to `source`: conf.py, the home page, the labs with figures, the docs.

    `only` names the labs to give pages (02_collectives, ...): all of them if None.
    """
    if source.exists():
        shutil.rmtree(source)
    (source / "labs").mkdir(parents=True)
    (source / "docs").mkdir()
    (source / "_static").mkdir()
    found = [lab for lab in labs(repo / "labs", repo / "docs" / "teaching.md") if only is None or lab.name in only]
    pages = {f"labs/{lab.name}.ipynb" for lab in found} | {"index.md", "contributing.md"}
    pages |= {f"docs/{p.name}" for p in (repo / "docs").glob("*.md")}
    pages |= {f"docs/img/{p.name}" for p in (repo / "docs" / "img").glob("*")}
    (source / "conf.py").write_text(CONF.format(title=settings.title))
    png, alt = lab_map(found)
    (source / "_static" / "lab_map.png").write_bytes(png)
    (source / "_static" / "a11y.css").write_text(A11Y_CSS)
    (source / "index.md").write_text(home_page(found, settings, alt))
    for page in (repo / "docs").glob("*.md"):
        (source / "docs" / page.name).write_text(_rewrite_links(page.read_text(), "docs", settings, pages))
    shutil.copytree(repo / "docs" / "img", source / "docs" / "img")
    (source / "contributing.md").write_text(_rewrite_links((repo / "CONTRIBUTING.md").read_text(), "", settings, pages))
    for lab in found:
        notebook = nbformat.read(repo / "labs" / f"{lab.name}.ipynb", as_version=4)
        (source / "labs" / f"{lab.name}.ipynb").write_text(nbformat.writes(page_of_lab(notebook, lab, settings, pages)))
    return found


def page_of_lab(
    notebook: nbformat.NotebookNode, lab: Lab, settings: Settings, pages: set[str]
) -> nbformat.NotebookNode:
    """The lab as its page shows it: links fixed, a launch link under the title, the library's figures drawn."""
    page = copy.deepcopy(notebook)
    for cell in page.cells:
        if cell.cell_type == "markdown":
            cell.source = _rewrite_links(cell.source, "labs", settings, pages)
        elif cell.cell_type == "code" and (call := _figure_call(cell.source)) is not None:
            png, alt = draw_figure(*call)
            cell.outputs = [
                nbformat.v4.new_output("display_data", data={"image/png": b64encode(png).decode(), "text/plain": alt})
            ]
            cell.metadata["mystnb"] = {"image": {"alt": alt}}
    launch = nbformat.v4.new_markdown_cell(
        f"[Open this lab on the class's JupyterHub]({launch_url(settings, lab.name + '.ipynb')}) "
        f"(it pulls the course into your home folder, `{settings.folder}/`, and opens `labs/{lab.name}.ipynb`)."
    )
    page.cells.insert(1, launch)
    return page


def build(out: Path, settings: Settings, repo: Path = REPO, only: Sequence[str] | None = None) -> Path:
    """Stage the site under out/src (`only` these labs, if given) and build it with Sphinx into out/html.

    Returns the home page's path.
    """
    stage(out / "src", settings, repo, only)
    html = out / "html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-b",
            "html",
            "-q",
            "-E",
            "-d",
            str(out / "doctrees"),
            str(out / "src"),
            str(html),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"ddlab site: sphinx failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    (out / "warnings.txt").write_text(done.stderr)
    for page in html.rglob("*.html"):
        page.write_text(accessible(page.read_text()))
    return html / "index.html"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlab.tools.site", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the build folder: the site goes to OUT/html")
    parser.add_argument("--config", type=Path, default=CONFIG, help=f"the site's settings (default {CONFIG})")
    parser.add_argument("--hub", help="the class's JupyterHub, overriding the config's hub")
    parser.add_argument("--repository", help="the git URL the hub pulls the course from, overriding the config's")
    parser.add_argument("--branch", help="the branch it pulls, overriding the config's")
    args = parser.parse_args(argv)
    settings = load_settings(args.config, hub=args.hub, repository=args.repository, branch=args.branch)
    index = build(args.out, settings)
    print(f"wrote {index}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
