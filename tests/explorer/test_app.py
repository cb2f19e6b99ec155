"""The Gradio app (examples/app.py) in headless chromium: served on 127.0.0.1 only, a prompt's page shows the
steps energy_trace and energy_generate give for it, and bad input gets a message in the page, never a trace."""

from __future__ import annotations

import socket

import pytest
from _browser import webdriver
from _scripts import load_script
from _tiny import save_tiny

webdriver()  # selenium, or a skip (a failure under CI) before the imports below
pytest.importorskip("gradio", reason='the app needs Gradio: pip install -e ".[app]"')
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from modeling_brillm.decoding import energy_generate
from modeling_brillm.explorer import label, load_model
from modeling_brillm.interpretability import energy_trace

pytestmark = pytest.mark.slow  # Gradio's import and server start take ~10 s of the ~30 s on two cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("app") / "model"
    save_tiny(path)
    return path


@pytest.fixture(scope="module")
def served(folder):
    app_module = load_script("examples/app.py", "brillm_app")
    app = app_module.build(str(folder))
    _, url, _ = app_module.serve(app, free_port(), block=False)
    yield app, url
    app.close()


def test_the_app_listens_on_loopback_only(served):
    app, url = served
    assert app.server_name == "127.0.0.1" and url.startswith("http://127.0.0.1:")


def fill(browser, selector, text):
    box = browser.find_element(By.CSS_SELECTOR, selector)
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    if text:
        box.send_keys(text)


def run(browser, expect: str) -> str:
    """Click Generate and wait for a status holding `expect`; returns the status."""
    browser.find_element(By.ID, "run").click()
    status = lambda b: b.find_element(By.CSS_SELECTOR, "#status textarea").get_attribute("value")
    WebDriverWait(browser, 60).until(lambda b: expect in status(b))
    return status(browser)


def enter_page(browser):
    frame = browser.find_element(By.CSS_SELECTOR, "#view iframe")
    browser.switch_to.frame(frame)
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.CSS_SELECTOR, "body[data-ready]"))


def text_of(element) -> str:
    return element.get_attribute("textContent")


def test_a_prompt_shows_its_trace_and_continuation(browser, served, folder, tmp_path):
    _, url = served
    browser.get(url)
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.CSS_SELECTOR, "#prompt textarea"))
    fill(browser, "#prompt textarea", "the cat sat")
    status = run(browser, "tokens generated")
    model, tokenizer = load_model(str(folder))
    trace = energy_trace(model, "the cat sat", tokenizer, top_k=5)
    assert status.startswith(f"{len(trace)} steps traced")
    shot = tmp_path / "app.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    enter_page(browser)
    try:
        chips = browser.find_elements(By.CSS_SELECTOR, "#view-trace .step[data-step]")
        assert [text_of(c.find_element(By.CLASS_NAME, "tok")) for c in chips] == [
            label(s.target_text) for s in trace.steps()]
        assert [float(text_of(c.find_element(By.CLASS_NAME, "e"))) for c in chips] == pytest.approx(
            trace.energies.tolist(), abs=6e-4)
        chips[4].click()
        box = browser.find_element(By.CSS_SELECTOR, "#view-trace .details")
        assert box.get_attribute("data-step") == "4"
        rows = box.find_elements(By.CSS_SELECTOR, "table.alts tr.alt")
        assert [int(r.get_attribute("data-token")) for r in rows] == trace.alternative_tokens[4].tolist()
        browser.find_element(By.ID, "tab-generation").click()
        out = energy_generate(model, tokenizer("the cat sat", return_tensors="pt")["input_ids"], max_new_tokens=20)
        shown = browser.find_elements(By.CSS_SELECTOR, "#view-generation .step[data-step]")
        assert [int(c.get_attribute("data-step")) for c in shown] == list(range(len(out.path(0))))
        assert [float(text_of(c.find_element(By.CLASS_NAME, "e"))) for c in shown] == pytest.approx(
            [s.energy for s in out.path(0)], abs=6e-4)
    finally:
        browser.switch_to.default_content()


@pytest.mark.parametrize(("model", "prompt", "message"), [
    ("{tmp}", "the cat", "is not a BriLLM model folder"),
    ("{folder}", "", "the text is empty"),
    ("{folder}", "the cat sat on the mat " * 4, "tick \u201cread past the trained positions\u201d"),
], ids=["not-a-model", "empty-text", "past-the-positions"])
def test_bad_input_gets_a_message_in_the_page(browser, served, folder, tmp_path, model, prompt, message):
    _, url = served
    browser.get(url)
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.CSS_SELECTOR, "#prompt textarea"))
    fill(browser, "#model textarea, #model input", model.format(tmp=tmp_path, folder=folder))
    fill(browser, "#prompt textarea", prompt)
    status = run(browser, "error: ")
    assert message in status and "Traceback" not in status
    enter_page(browser)
    try:
        assert message in text_of(browser.find_element(By.ID, "error"))
        assert browser.find_elements(By.CSS_SELECTOR, ".step") == []
    finally:
        browser.switch_to.default_content()
