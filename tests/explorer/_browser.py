"""The explorer's browser: headless chromium driven by selenium.

Locally the browser tests skip when chromium, chromedriver or selenium is missing; with the environment variable CI
set (.ci/run runs with CI=true and installs chromium first) they fail instead, so CI cannot skip them silently."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUMS = ("chromium", "chromium-browser", "google-chrome")


def missing(reason: str):
    message = f"the explorer's browser tests need {reason}"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so they fail rather than skip: see .ci/run)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def webdriver():
    """selenium's webdriver module, or a skip (a failure under CI) at collection when selenium is missing."""
    try:
        from selenium import webdriver
    except ImportError:
        missing('selenium: pip install -e ".[browser]"')
    return webdriver


def start_browser(width: int = 1280, height: int = 900):
    from selenium.webdriver.chrome.service import Service

    driver_module = webdriver()
    binary = next((shutil.which(name) for name in CHROMIUMS if shutil.which(name)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        missing("chromium and chromedriver: apt-get install chromium chromium-driver")
    options = driver_module.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return driver_module.Chrome(options=options, service=Service(driver))
