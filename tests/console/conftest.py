"""The browser the console's tests drive: Debian's chromium through Playwright (never a browser
that Playwright downloads), one per test module, and a fresh page (its own context) per test."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",  # as root, in a container
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PAGE_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extras")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    yield context.new_page()
    context.close()


@pytest.fixture
def new_context(browser: Any) -> Iterator[Any]:
    """Makes contexts of the test's own options (a color scheme, permissions), closed after it."""
    made: list[Any] = []

    def make(**options: Any) -> Any:
        context = browser.new_context(**options)
        context.set_default_timeout(PAGE_TIMEOUT_MS)
        made.append(context)
        return context

    yield make
    for context in made:
        context.close()
