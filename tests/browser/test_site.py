"""The course site in Chromium: the home page and every lab page, served over loopback HTTP.

Each page loads, every link to the site resolves (fetched by the browser), every image loads and
has a text alternative, equations render (MathJax, served by the site itself), and axe-core, the
accessibility engine, finds no serious or critical violation. Set-up installs axe-core from the
npm registry into a cache folder outside the repository (like the hub's proxy); the site's tools
come with the `course_site` fixture (tests/conftest.py).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import threading
import urllib.parse
from pathlib import Path

import pytest
from browser_support import Missing, skip_or_fail

AXE = "axe-core@4.14.1"
#: Images and links each page must show; what axe-core may find (its impacts are minor, moderate, serious, critical).
BLOCKING = ("serious", "critical")


def npm_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ddlab" / "npm"


def install_axe() -> Path:
    """axe.min.js, installed with npm unless it is there; Missing if it cannot be."""
    script = npm_cache() / "node_modules" / "axe-core" / "axe.min.js"
    if not script.exists():
        if shutil.which("npm") is None:
            raise Missing("axe-core is not installed and there is no npm to install it")
        npm_cache().mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(npm_cache()), AXE],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0 or not script.exists():
            raise Missing(f"`npm install {AXE}` failed:\n{done.stderr[-2000:]}")
    return script


@pytest.fixture(scope="module")
def served(browser, course_site):
    """The built site on a loopback HTTP server: (base URL, html folder, axe script)."""
    try:
        axe = install_axe()
    except Missing as err:
        skip_or_fail("site accessibility", err)
    folder, _ = course_site
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", folder, axe
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def _pages(folder: Path) -> list[str]:
    return ["index.html", *sorted(f"labs/{p.name}" for p in (folder / "labs").glob("*.html"))]


def test_every_page_loads_with_its_links_images_equations_and_no_serious_accessibility_violation(page, served):
    base, folder, axe = served
    pages = _pages(folder)
    assert len(pages) == 1 + len(list((Path(__file__).parents[2] / "labs").glob("[0-9][0-9]_*.ipynb")))
    checked: dict[str, int] = {}
    problems: list[str] = []
    for name in pages:
        answer = page.goto(f"{base}/{name}", wait_until="load")
        if answer is None or not answer.ok:
            problems.append(f"{name}: answered {answer and answer.status}")
            continue
        if page.locator("span.math, div.math").count():
            page.wait_for_function(
                "document.querySelectorAll('mjx-container').length >="
                " document.querySelectorAll('span.math, div.math').length",
                timeout=60_000,
            )
        images = page.evaluate(
            "[...document.images].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0, i.alt])"
        )
        problems += [f"{name}: image {src} did not load" for src, loaded, _ in images if not loaded]
        problems += [f"{name}: image {src} has no text alternative" for src, _, alt in images if not alt.strip()]
        for href in page.evaluate("[...document.querySelectorAll('a[href]')].map(a => a.href)"):
            url = urllib.parse.urlsplit(href)
            target = urllib.parse.urlunsplit((url.scheme, url.netloc, url.path, url.query, ""))
            if not href.startswith(base) or target in checked:
                continue
            checked[target] = page.request.get(target).status
            if checked[target] != 200:
                problems.append(f"{name}: link {href} answered {checked[target]}")
        page.add_script_tag(path=str(axe))
        violations = page.evaluate(
            "async () => (await axe.run(document, {resultTypes: ['violations']})).violations"
            ".map(v => [v.id, v.impact, v.help, v.nodes.length, v.nodes[0].target.join(' ')])"
        )
        problems += [
            f"{name}: {rule} ({impact}): {what}, {count} elements, e.g. {where}"
            for rule, impact, what, count, where in violations
            if impact in BLOCKING
        ]
    assert checked, "no link to the site was followed"
    assert not problems, "\n".join(problems)
