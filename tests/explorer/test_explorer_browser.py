"""The explorer's page in headless chromium: the steps, energies and alternatives it shows are energy_trace's and
energy_generate's, hovering and clicking show a step's details, tokens that are markup stay text, and a 2,000-step
page over 4,000 nodes pages its steps."""

from __future__ import annotations

import time

import pytest
import torch
from _browser import webdriver
from _pages import TEXT, TRICKY, big_model, tricky_model

webdriver()  # selenium, or a skip (a failure under CI) before the imports below
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from modeling_brillm.decoding import energy_generate
from modeling_brillm.explorer import Explorer, explore, label, mix_weights, neighbourhoods
from modeling_brillm.interpretability import energy_trace

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny():
    return tricky_model()


@pytest.fixture(scope="module")
def trace(tiny):
    model, tokenizer = tiny
    return energy_trace(model, TEXT, tokenizer, top_k=5)


@pytest.fixture(scope="module")
def page(tiny, tmp_path_factory):
    model, tokenizer = tiny
    path = tmp_path_factory.mktemp("explorer") / "page.html"
    explore(model, TEXT, tokenizer, prompt="the dog", max_new_tokens=12).save(path)
    return path


def open_page(browser, path):
    browser.get(path.as_uri())
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.CSS_SELECTOR, "body[data-ready]"))


def text_of(element) -> str:
    return element.get_attribute("textContent")  # exactly, whitespace and all (.text trims and folds)


def shown_energy(element) -> float:
    return float(text_of(element))


def details(browser, view="trace"):
    return browser.find_element(By.CSS_SELECTOR, f"#view-{view} .details")


def field(browser, name, view="trace") -> str:
    return text_of(details(browser, view).find_element(By.CSS_SELECTOR, f'[data-field="{name}"]'))


def chips(browser, view="trace"):
    return browser.find_elements(By.CSS_SELECTOR, f"#view-{view} .step[data-step]")


def test_the_steps_shown_are_energy_traces(browser, page, trace):
    open_page(browser, page)
    shown = chips(browser)
    assert len(shown) == len(trace)
    for chip, step in zip(shown, trace.steps()):
        assert text_of(chip.find_element(By.CLASS_NAME, "tok")) == label(step.target_text)
        assert shown_energy(chip.find_element(By.CLASS_NAME, "e")) == pytest.approx(step.energy, abs=6e-4)
        classes = chip.get_attribute("class").split()
        assert ("r1" in classes) == (step.rank == 1) and ("shared" in classes) == (not step.real_edge)
    assert text_of(browser.find_element(By.CSS_SELECTOR, "#view-trace .summary")).startswith(f"{len(trace)} steps")
    assert browser.execute_script("return window.pwned") is None  # no token ran as code
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_clicking_a_step_shows_its_details(browser, page, trace, tiny):
    model, _ = tiny
    steps = trace.steps()
    worst = max(range(len(steps)), key=lambda i: steps[i].rank)
    assert steps[worst].rank > 1  # the added tokens are never the model's pick
    for i in sorted({0, 3, worst, len(steps) - 1}):
        step = steps[i]
        chips(browser)[i].click()
        assert details(browser).get_attribute("data-step") == str(i)
        assert "selected" in chips(browser)[i].get_attribute("class")
        assert field(browser, "source") == label(step.source_text)
        assert field(browser, "target") == label(step.target_text)
        assert float(field(browser, "energy")) == pytest.approx(step.energy, abs=6e-4)
        assert field(browser, "rank") == f"{step.rank} of {model.config.vocab_size}"
        predicted = field(browser, "predicted")
        assert predicted == "the true next token" if step.rank == 1 else predicted.startswith(
            label(step.predicted_text) + " (")
        rows = details(browser).find_elements(By.CSS_SELECTOR, "table.alts tr.alt")
        assert [int(r.get_attribute("data-token")) for r in rows] == [t for t, _ in step.alternatives]
        assert [text_of(r.find_element(By.CLASS_NAME, "tok")) for r in rows] == list(map(label, step.alternative_texts))
        assert [shown_energy(r.find_element(By.CLASS_NAME, "e")) for r in rows] == pytest.approx(
            [e for _, e in step.alternatives], abs=6e-4)
        mix = details(browser).find_elements(By.CSS_SELECTOR, ".mixtable tr")
        if i == 0:
            assert mix == [] and "start signal" in text_of(details(browser))
            continue
        weights = mix_weights(model, i)
        order = sorted(range(i), key=lambda k: (-float(weights[k]), -k))[:8]
        assert [int(r.get_attribute("data-position")) for r in mix] == [k + 1 for k in order]
        assert [float(r.get_attribute("data-weight")) for r in mix] == pytest.approx(
            [float(weights[k]) for k in order], abs=1e-6)


def test_hovering_a_step_shows_it_and_leaving_restores_the_pinned_one(browser, page, trace):
    open_page(browser, page)
    chips(browser)[2].click()
    ActionChains(browser).move_to_element(chips(browser)[5]).perform()
    assert details(browser).get_attribute("data-step") == "5"
    assert field(browser, "target") == label(trace.steps()[5].target_text)
    ActionChains(browser).move_to_element(browser.find_element(By.TAG_NAME, "h1")).perform()
    assert details(browser).get_attribute("data-step") == "2"


def test_tokens_that_are_markup_are_shown_as_text(browser, page, tiny, tmp_path):
    open_page(browser, page)
    labels = [text_of(c.find_element(By.CLASS_NAME, "tok")) for c in chips(browser)]
    assert TRICKY[0] in labels and TRICKY[1] in labels and TRICKY[2] in labels and "\\u202eevil" in labels
    assert "\u21e5" in labels and "\u2407" in labels and "\u21b5" in labels
    assert browser.find_elements(By.CSS_SELECTOR, "#app script, #app img") == []
    assert browser.execute_script("return window.pwned") is None
    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == PNG and shot.stat().st_size > 10_000


def test_the_generation_view_is_energy_generates(browser, page, tiny):
    model, tokenizer = tiny
    open_page(browser, page)
    browser.find_element(By.ID, "tab-generation").click()
    assert browser.find_element(By.ID, "view-generation").is_displayed()
    assert not browser.find_element(By.ID, "view-trace").is_displayed()
    out = energy_generate(model, tokenizer("the dog", return_tensors="pt")["input_ids"], max_new_tokens=12,
                          num_alternatives=5, tokenizer=tokenizer)
    path = out.path(0)
    shown = chips(browser, "generation")
    assert len(shown) == len(path)
    for chip, step in zip(shown, path):
        assert text_of(chip.find_element(By.CLASS_NAME, "tok")) == label(step.token_text)
        assert shown_energy(chip.find_element(By.CLASS_NAME, "e")) == pytest.approx(step.energy, abs=6e-4)
    shown[-1].click()
    rows = details(browser, "generation").find_elements(By.CSS_SELECTOR, "table.alts tr.alt")
    assert [text_of(r.find_element(By.CLASS_NAME, "tok")) for r in rows] == list(map(label, path[-1].alternative_texts))
    assert field(browser, "rank", "generation") == f"{path[-1].rank} of {model.config.vocab_size}"


def test_a_node_link_opens_its_neighbourhood(browser, page, tiny, trace):
    model, tokenizer = tiny
    open_page(browser, page)
    chips(browser)[1].click()  # the signal sits on 't' of "the"
    details(browser).find_element(By.CSS_SELECTOR, '[data-field="source"] a').click()
    assert browser.find_element(By.ID, "view-node").is_displayed()
    node = int(trace.tokens[1])
    box = browser.find_element(By.CSS_SELECTOR, "#view-node .details")
    assert box.get_attribute("data-node") == str(node)
    generated = energy_generate(model, tokenizer("the dog", return_tensors="pt")["input_ids"], max_new_tokens=12)
    expected = neighbourhoods(model, [trace.tokens.tolist(), generated.sequences[0].tolist()], (), 10)[node]
    rows = box.find_elements(By.CSS_SELECTOR, "tr.edge")
    assert [int(r.get_attribute("data-token")) for r in rows] == [v for v, _, _ in expected["edges"]]
    assert [shown_energy(r.find_element(By.CLASS_NAME, "e")) for r in rows] == pytest.approx(
        [e for _, e, _ in expected["edges"]], abs=6e-4)
    assert f"mean over {expected['count']} steps" in text_of(box)


def test_the_notebook_view_is_the_page_in_an_iframe(browser, tiny, trace, tmp_path):
    """What a notebook cell inserts (`_repr_html_`) renders the same page, the tricky tokens still as text."""
    model, tokenizer = tiny
    host = tmp_path / "notebook.html"
    cell = explore(model, TEXT, tokenizer)._repr_html_()
    host.write_text(f"<!DOCTYPE html><html><body><div class='output'>{cell}</div></body></html>", encoding="utf-8")
    browser.get(host.as_uri())
    browser.switch_to.frame(browser.find_element(By.CSS_SELECTOR, "iframe.brillm-explorer"))
    try:
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.CSS_SELECTOR, "body[data-ready]"))
        labels = [text_of(c.find_element(By.CLASS_NAME, "tok")) for c in chips(browser)]
        assert labels == [label(s.target_text) for s in trace.steps()] and TRICKY[0] in labels
        assert browser.execute_script("return window.pwned") is None
    finally:
        browser.switch_to.default_content()
    assert browser.execute_script("return window.pwned") is None


def test_an_error_page_shows_its_message_as_text(browser, tmp_path):
    path = tmp_path / "error.html"
    Explorer.error("the text is empty: <b>give</b> at least one token").save(path)
    open_page(browser, path)
    assert text_of(browser.find_element(By.ID, "error")) == "the text is empty: <b>give</b> at least one token"
    assert browser.find_elements(By.CSS_SELECTOR, "#error b") == []


def test_a_2000_token_page_over_4000_nodes_is_paged(browser, tmp_path):
    model, ids = big_model()
    path = tmp_path / "big.html"
    explore(model, ids).save(path)
    trace = energy_trace(model, ids, top_k=5)
    start = time.perf_counter()
    open_page(browser, path)
    load_seconds = time.perf_counter() - start
    assert path.stat().st_size < 2_000_000 and load_seconds < 10
    assert [int(c.get_attribute("data-step")) for c in chips(browser)] == list(range(200))
    browser.find_element(By.CSS_SELECTOR, "#view-trace .next").click()
    assert [int(c.get_attribute("data-step")) for c in chips(browser)] == list(range(200, 400))
    go = browser.find_element(By.CSS_SELECTOR, "#view-trace .goto")
    go.send_keys("1500")
    go.send_keys("\n")
    assert details(browser).get_attribute("data-step") == "1500"
    assert int(chips(browser)[0].get_attribute("data-step")) == 1400  # the page holding it
    assert float(field(browser, "energy")) == pytest.approx(float(trace.energies[1500]), abs=6e-4)
    assert field(browser, "rank") == f"{int(trace.ranks[1500])} of 4000"
    mix = details(browser).find_elements(By.CSS_SELECTOR, ".mixtable tr")
    weights = mix_weights(model, 1500)
    assert float(mix[0].get_attribute("data-weight")) == pytest.approx(float(weights.max()), abs=1e-7)
    chart = browser.find_element(By.CSS_SELECTOR, "#view-trace .chart")
    ActionChains(browser).move_to_element(chart).click().perform()  # the middle of the chart: step ~1000
    picked = int(details(browser).get_attribute("data-step"))
    assert abs(picked - 1000) < 20 and int(chips(browser)[0].get_attribute("data-step")) == picked // 200 * 200
    assert torch.isfinite(trace.energies).all()
