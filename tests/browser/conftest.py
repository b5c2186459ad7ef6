"""A real browser for the tests in this folder: the distribution's Chromium, driven by Playwright.

Set-up installs what is missing: Chromium with apt-get (as root; no browser download),
Playwright's Python package with pip into this environment. Where that cannot be done the
tests skip and say what is missing; with CI=true they fail instead. DDLAB_BROWSER_TESTS=0
skips them outside CI. A failed test leaves a screenshot of its page and the text of every
cell in out/browser/ (ignored by git).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # browser_support, notebook_page

from browser_support import ARTEFACTS, CHROMIUM, IN_CI, Missing, install_browser, skip_or_fail  # noqa: E402


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium under Playwright (no browser download: the distribution's Chromium)."""
    if os.environ.get("DDLAB_BROWSER_TESTS") == "0" and not IN_CI:
        pytest.skip("browser tests skipped: DDLAB_BROWSER_TESTS=0.")
    try:
        install_browser()
    except Missing as err:
        skip_or_fail("browser", err)
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    try:
        # As root, Chromium runs only without its sandbox (containers, CI).
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"] if os.geteuid() == 0 else []
        )
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        playwright.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if call.when == "call":
        item.failed_call = outcome.get_result().failed


@pytest.fixture
def page(browser, request: pytest.FixtureRequest):
    """A fresh browser page; if the test fails, its screenshot and cells go to out/browser/<test>.png."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    tab = context.new_page()
    tab.set_default_timeout(60_000)
    tab.notebook = None  # the test sets a NotebookPage here to get its cells saved on failure
    try:
        yield tab
    finally:
        if getattr(request.node, "failed_call", False):
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.name)
            with contextlib.suppress(Exception):
                if tab.notebook is not None:
                    tab.notebook.screenshot(ARTEFACTS / f"{name}.png")
                else:
                    ARTEFACTS.mkdir(parents=True, exist_ok=True)
                    tab.screenshot(path=str(ARTEFACTS / f"{name}.png"))
        context.close()
