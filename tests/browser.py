"""A real browser for the server's pages: Debian's Chromium driven by Playwright's sync API.

Playwright's own browser download is never used (`.ci/run` installs the distribution's Chromium);
the flags keep the browser from reaching anything but the server under test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tandem.bench.serve_rounds import CHROMIUM_FLAGS


def chromium_path() -> str:
    """Debian's Chromium; without it the test fails (CI installs it) or, outside CI, skips."""
    path = os.environ.get("TANDEM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        message = "Chromium is not installed (apt-get install chromium)"
        if os.environ.get("TANDEM_REQUIRE_REAL_MODEL"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@contextmanager
def chromium() -> Iterator:
    """A headless Chromium (a playwright.sync_api.Browser) for the duration of the block."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()
