"""The explorer's browser: headless chromium driven by selenium, one session per test module.

Locally the browser tests skip when chromium, chromedriver or selenium is missing; with the environment variable CI
set (.ci/run runs with CI=true and installs chromium first) they fail instead, so CI cannot skip them silently."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUMS = ("chromium", "chromium-browser", "google-chrome")


def _missing_browser(reason: str):
    message = f"the explorer's browser tests need {reason}"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set: install it, see .ci/run)", pytrace=False)
    pytest.skip(message)


def start_browser(width: int = 1280, height: int = 900):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing_browser('selenium: pip install -e ".[browser]"')
    binary = next((shutil.which(name) for name in CHROMIUMS if shutil.which(name)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        _missing_browser("chromium and chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def browser():
    driver = start_browser()
    yield driver
    driver.quit()
