"""The Gradio app (modeling_brillm/explorer/app.py, behind examples/app.py) in headless chromium: served on 127.0.0.1
only, it offers the models of its command line, a prompt's page shows the steps energy_trace and energy_generate
give for it, bad input gets a message in the page (never a trace), and a path typed into an app that allows any
model reads the same whether or not it exists on the server."""

from __future__ import annotations

import socket

import pytest
from _browser import webdriver
from _tiny import save_tiny

webdriver()  # selenium, or a skip (a failure under CI) before the imports below
pytest.importorskip("gradio", reason='the app needs Gradio: pip install -e ".[app]"')
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from modeling_brillm import energy_generate, energy_trace
from modeling_brillm.explorer import app as explorer_app
from modeling_brillm.explorer import label, load_model

pytestmark = pytest.mark.slow  # Gradio's import and server start take ~10 s of the ~30 s on two cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    save_tiny(root / "model")
    save_tiny(root / "second", seed=1)
    return root / "model", root / "second"


@pytest.fixture(scope="module")
def app_module():
    return explorer_app


def start(app_module, *args, **kwargs):
    app = app_module.build(*args, **kwargs)
    _, url, _ = app_module.serve(app, free_port(), block=False)
    return app, url


@pytest.fixture(scope="module")
def served(app_module, folders):
    app, url = start(app_module, [str(f) for f in folders])
    yield app, url
    app.close()


@pytest.fixture(scope="module")
def open_to_any(app_module, folders):
    app, url = start(app_module, [str(folders[0])], allow_any=True)
    yield app, url
    app.close()


def test_the_app_listens_on_loopback_only(served):
    app, url = served
    assert app.server_name == "127.0.0.1" and url.startswith("http://127.0.0.1:")


def fill(browser, selector, text, enter=False):
    box = browser.find_element(By.CSS_SELECTOR, selector)
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    if text:
        box.send_keys(text)
    if enter:
        box.send_keys(Keys.ENTER)


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


def open_app(browser, url):
    browser.get(url)
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.CSS_SELECTOR, "#prompt textarea"))


def test_the_page_offers_the_models_of_the_command_line(browser, served, folders):
    _, url = served
    open_app(browser, url)
    box = browser.find_element(By.CSS_SELECTOR, "#model input")
    assert box.get_attribute("value") == str(folders[0])
    box.click()
    options = WebDriverWait(browser, 10).until(lambda b: b.find_elements(By.CSS_SELECTOR, "[role=option]"))
    assert [o.get_attribute("aria-label") or text_of(o).strip() for o in options] == [str(f) for f in folders]


def test_a_prompt_shows_its_trace_and_continuation(browser, served, folders, tmp_path):
    _, url = served
    open_app(browser, url)
    fill(browser, "#prompt textarea", "the cat sat")
    status = run(browser, "tokens generated")
    model, tokenizer = load_model(str(folders[0]))
    trace = energy_trace(model, "the cat sat", tokenizer, top_k=5)
    assert status.startswith(f"{len(trace)} steps traced")
    shot = tmp_path / "app.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    enter_page(browser)
    try:
        chips = browser.find_elements(By.CSS_SELECTOR, "#view-trace .strip .step[data-step]")
        assert [text_of(c.find_element(By.CLASS_NAME, "tok")) for c in chips] == [
            label(s.target_text) for s in trace.steps()]
        assert [float(text_of(c.find_element(By.CLASS_NAME, "e"))) for c in chips] == pytest.approx(
            trace.energies.tolist(), abs=6e-4)
        assert text_of(browser.find_element(By.TAG_NAME, "h1")) == "BriLLM explorer: model"
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


@pytest.mark.parametrize(("prompt", "message"), [
    ("", "the prompt is empty: type a few words"),
    ("the cat sat on the mat " * 4, "tick \u201cread past the trained positions\u201d to read past them."),
], ids=["empty-prompt", "past-the-positions"])
def test_bad_input_gets_a_message_in_the_page(browser, served, prompt, message):
    _, url = served
    open_app(browser, url)
    fill(browser, "#prompt textarea", prompt)
    status = run(browser, "error: ")
    assert message in status and "Traceback" not in status and "model.config" not in status
    enter_page(browser)
    try:
        assert message in text_of(browser.find_element(By.ID, "error"))
        assert browser.find_elements(By.CSS_SELECTOR, ".step") == []
    finally:
        browser.switch_to.default_content()


def test_a_typed_path_reads_the_same_whether_or_not_it_exists(browser, open_to_any, tmp_path):
    _, url = open_to_any
    (tmp_path / "exists").mkdir()
    statuses = []
    for name in (str(tmp_path / "exists"), str(tmp_path / "missing"), "/etc"):
        open_app(browser, url)
        fill(browser, "#model input", name, enter=True)
        fill(browser, "#prompt textarea", "the cat")
        statuses.append(run(browser, "error: ").replace(repr(name), "NAME"))
    assert len(set(statuses)) == 1 and statuses[0].startswith("error: cannot open NAME as a BriLLM model")
