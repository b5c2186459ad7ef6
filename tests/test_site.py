"""The course site (`make site`): built once here from the repository, then read as files.

No solution code on any page (every line of every solution block that the labs and docs do not
also show is searched for in every built file); every internal link and anchor resolves, every
image exists and has a text alternative; every lab has its page with the launch link, and the
home page lists every lab with its time from docs/teaching.md. The site is built once per session
(the `course_site` fixture of tests/conftest.py); the browser's view of it is in
tests/browser/test_site.py.
"""

from __future__ import annotations

import html
import re
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
#: Solution lines shorter than this ("return None", "continue") say nothing and occur anywhere: not searched.
MIN_LINE = 12
#: An image's alt shorter than this says nothing of what it shows (ddlab.plots.alt.MIN_ALT); nor does nbconvert's filler.
MIN_ALT = 20
NBCONVERT_ALT = "No description has been provided for this image"


@pytest.fixture(scope="module")
def site(course_site):
    """The site built as `make site` builds it (tests/conftest.py): (html folder, settings)."""
    return course_site


class Page(HTMLParser):
    """What a page links to, shows, names: hrefs, images with their alt, element ids, visible text."""

    def __init__(self, text: str):
        super().__init__()
        self.links: list[str] = []
        self.images: list[tuple[str, str | None]] = []
        self.ids: set[str] = set()
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        if tag == "a" and values.get("href"):
            self.links.append(values["href"])
        if tag == "img":
            self.images.append((values.get("src") or "", values.get("alt")))

    def handle_data(self, data):
        self.text.append(data)


def squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def solution_lines(exclude: str) -> set[str]:
    """Lines of every solution block in solutions/ that `exclude` (what the site may show) does not hold."""
    lines = set()
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            inside = False
            for line in cell.source.splitlines():
                if line.strip() == BEGIN:
                    inside = True
                elif line.strip() == END:
                    inside = False
                elif inside and len(squeeze(line)) >= MIN_LINE and squeeze(line) not in exclude:
                    lines.add(squeeze(line))
    return lines


def site_text(folder: Path) -> str:
    """Every built file's text: pages with tags removed and entities decoded, the search index and sources.

    _static holds Sphinx's, the theme's and MathJax's own files (and the home page's map).
    """
    parts = []
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".html":
            parts.append(squeeze("".join(Page(path.read_text()).text)))
        elif path.suffix in (".js", ".txt", ".ipynb", ".json", ".md") and "_static" not in path.parts:
            parts.append(squeeze(html.unescape(path.read_text(errors="replace"))))
    return "\n".join(parts)


def allowed_text() -> str:
    """What the site is built from, which may show: the labs, the docs, CONTRIBUTING.md (a lab's text that states
    a contract, such as return `"arrived"`, shows the words a solution line may hold too)."""
    sources = [nbformat.read(p, as_version=4) for p in sorted((ROOT / "labs").glob("*.ipynb"))]
    texts = [c.source for nb in sources for c in nb.cells]
    texts += [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))] + [(ROOT / "CONTRIBUTING.md").read_text()]
    return "\n".join(squeeze(text.replace("`", "")) for text in texts)  # as pages show code spans: no backticks


def test_no_solution_code_on_any_page(site):
    folder, _ = site
    lines = solution_lines(allowed_text())
    assert len(lines) > 500, f"only {len(lines)} solution lines to look for: is the search reading solutions/?"
    text = site_text(folder)
    shown = sorted(line for line in lines if line in text)
    assert not shown, f"{len(shown)} lines of solution code on the site, e.g. {shown[:5]}"
    # The search finds a solution line in a page as the site would write it (highlighted, escaped).
    line = sorted(lines)[0]
    page = "<pre>" + "".join(f'<span class="n">{html.escape(ch)}</span>' for ch in line) + "</pre>"
    assert line in squeeze("".join(Page(page).text))


def test_every_link_and_image_on_every_page_resolves(site):
    folder, settings = site
    pages = sorted(folder.rglob("*.html"))
    parsed = {path: Page(path.read_text()) for path in pages}
    broken, missing, no_alt = [], [], []
    for path, page in parsed.items():
        for href in page.links:
            url = urllib.parse.urlsplit(href)
            if url.scheme or href.startswith("mailto:"):
                continue
            target = (path.parent / urllib.parse.unquote(url.path)).resolve() if url.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{path.relative_to(folder)} -> {href}")
            elif url.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else Page(target.read_text()).ids
                if url.fragment not in ids:
                    broken.append(f"{path.relative_to(folder)} -> {href} (no such anchor)")
        for src, alt in page.images:
            if not (path.parent / urllib.parse.unquote(src)).is_file():
                missing.append(f"{path.relative_to(folder)}: {src}")
            if len((alt or "").strip()) < MIN_ALT or (alt or "").strip() in (Path(src).name, NBCONVERT_ALT):
                no_alt.append(f"{path.relative_to(folder)}: {src} (alt {alt!r})")
    assert not broken, f"broken links: {broken[:20]}"
    assert not missing, f"missing images: {missing[:20]}"
    assert not no_alt, f"images without a text alternative that says what they show: {no_alt[:20]}"


def test_every_lab_has_its_page_with_the_launch_link_and_its_time_on_the_home_page(site):
    from ddlab.tools.site import labs, launch_url, teaching_minutes

    folder, settings = site
    home = (folder / "index.html").read_text()
    found = labs(ROOT / "labs", ROOT / "docs" / "teaching.md")
    assert [lab.name for lab in found] == sorted(p.stem for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
    for lab in found:
        page = Page((folder / "labs" / f"{lab.name}.html").read_text())
        url = launch_url(settings, f"{lab.name}.ipynb")
        assert url in page.links, f"{lab.name}: no launch link"
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        assert query["urlpath"] == [f"lab/tree/{settings.folder}/labs/{lab.name}.ipynb"]
        assert url.startswith(settings.hub + "/hub/user-redirect/git-pull?")
        assert f'href="labs/{lab.name}.html"' in home
        if lab.number <= "16":  # the labs timed in docs/teaching.md
            assert lab.minutes is not None and f"about {lab.minutes} min" in home
    lab_03 = next(lab for lab in found if lab.number == "03")
    assert lab_03.minutes == teaching_minutes(ROOT / "docs" / "teaching.md")["03"] and lab_03.needs == ["01", "02"]
    assert 'alt="Map of the' in home and "lab 03 builds on lab 01, lab 02" in html.unescape(home)


def test_the_library_draws_the_labs_figures_with_the_text_alternative_the_lab_gives(site):
    from ddlab.tools.site import _figure_call

    folder, _ = site
    page = Page((folder / "labs" / "03_allreduce.html").read_text())
    drawn = [(src, alt) for src, alt in page.images if "_images/" in src]
    assert len(drawn) == 4, drawn  # three exchange patterns and the ring's steps, drawn from the lab's calls
    lab = nbformat.read(ROOT / "labs" / "03_allreduce.ipynb", as_version=4)
    given = [call[2]["alt"] for cell in lab.cells if cell.cell_type == "code" and (call := _figure_call(cell.source))]
    assert [alt for _, alt in drawn] == given and "Recursive doubling on 6 ranks: first ranks 1 and 3" in given[1]
    assert (folder / "search.html").is_file() and (folder / "searchindex.js").stat().st_size > 10_000
