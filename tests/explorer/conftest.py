"""One headless chromium per test module (see _browser.py: skipped locally without it, failed under CI)."""

from __future__ import annotations

import pytest
from _browser import start_browser


@pytest.fixture(scope="module")
def browser():
    driver = start_browser()
    yield driver
    driver.quit()
