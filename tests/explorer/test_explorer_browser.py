"""The explorer's page in headless chromium: the steps, energies and alternatives it shows are energy_trace's and
energy_generate's; the text reads as prose and byte pieces as the characters they make; the Node view shows a
node's real edges apart from the shared edge; the chart, colours, keys and paging behave as a reader expects; a
diff page shows both models; tokens that are markup stay text; a 2,000-step page over 4,000 nodes pages its steps."""

from __future__ import annotations

import math
import time

import pytest
import torch
from _browser import webdriver
from _pages import TEXT, TRICKY, WORLD, big_model, byte_model, release_chinese, successors, tricky_model

webdriver()  # selenium, or a skip (a failure under CI) before the imports below
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from modeling_brillm import energy_generate, energy_trace
from modeling_brillm.explorer import Explorer, compare, explore, label, mix_weights
from modeling_brillm.explorer.text import TokenText, prose

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


def chip(browser, i, view="trace"):
    return browser.find_element(By.CSS_SELECTOR, f'#view-{view} .strip .step[data-step="{i}"]')


def test_the_steps_shown_are_energy_traces(browser, page, trace):
    open_page(browser, page)
    shown = chips(browser)
    assert len(shown) == len(trace)
    for c, step in zip(shown, trace.steps()):
        assert text_of(c.find_element(By.CLASS_NAME, "tok")) == label(step.target_text)
        assert shown_energy(c.find_element(By.CLASS_NAME, "e")) == pytest.approx(step.energy, abs=6e-4)
        classes = c.get_attribute("class").split()
        assert ("r1" in classes) == (step.rank == 1) and ("shared" in classes) == (not step.real_edge)
    assert text_of(browser.find_element(By.CSS_SELECTOR, "#view-trace .summary")).startswith(f"{len(trace)} steps")
    assert browser.execute_script("return window.pwned") is None  # no token ran as code
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_the_page_opens_on_the_most_surprising_step(browser, page, trace):
    open_page(browser, page)
    worst = int(torch.argmax(trace.ranks))  # the first of the worst ranks
    assert details(browser).get_attribute("data-step") == str(worst)
    assert "selected" in chip(browser, worst).get_attribute("class")
    assert text_of(browser.find_element(By.TAG_NAME, "h1")) == "BriLLM explorer: BriLLM"


def test_clicking_a_step_shows_its_details(browser, page, trace, tiny):
    model, _ = tiny
    steps = trace.steps()
    for i in sorted({0, 3, len(steps) - 1}):
        step = steps[i]
        chip(browser, i).click()
        assert details(browser).get_attribute("data-step") == str(i)
        assert "selected" in chip(browser, i).get_attribute("class")
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
        assert [text_of(h) for h in details(browser).find_elements(By.CSS_SELECTOR, "table.alts thead th")][:2] == [
            "token", "energy"]
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
    chip(browser, 2).click()
    ActionChains(browser).move_to_element(chip(browser, 5)).perform()
    assert details(browser).get_attribute("data-step") == "5"
    assert field(browser, "target") == label(trace.steps()[5].target_text)
    ActionChains(browser).move_to_element(browser.find_element(By.TAG_NAME, "h1")).perform()
    assert details(browser).get_attribute("data-step") == "2"


def test_the_text_reads_as_prose_coloured_by_rank(browser, page, trace, tiny):
    _, tokenizer = tiny
    open_page(browser, page)
    box = browser.find_element(By.CSS_SELECTOR, "#view-trace .prose")
    assert text_of(box) == "<s>" + prose(TEXT)  # the text itself, its invisible characters marked
    words = box.find_elements(By.CSS_SELECTOR, ".w[data-step]")
    assert len(words) == len(trace)
    for w in words[:6]:
        i = int(w.get_attribute("data-step"))
        assert ("r1" in w.get_attribute("class").split()) == (int(trace.ranks[i]) == 1)
    ActionChains(browser).move_to_element(words[6]).perform()
    assert details(browser).get_attribute("data-step") == words[6].get_attribute("data-step")
    words[4].click()
    assert details(browser).get_attribute("data-step") == "4" and "selected" in words[4].get_attribute("class")


def test_tokens_that_are_markup_are_shown_as_text(browser, page, tiny, tmp_path):
    open_page(browser, page)
    labels = [text_of(c.find_element(By.CLASS_NAME, "tok")) for c in chips(browser)]
    assert TRICKY[0] in labels and TRICKY[1] in labels and TRICKY[2] in labels and "\\u202eevil" in labels
    assert "\u21e5" in labels and "\u2407" in labels and "\u21b5" in labels
    assert browser.find_elements(By.CSS_SELECTOR, "#app script, #app img") == []
    assert browser.execute_script("return window.pwned") is None
    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == PNG and shot.stat().st_size > 10_000


def test_the_chart_has_axes_and_rank_coloured_points(browser, page, trace):
    open_page(browser, page)
    chart = browser.find_element(By.CSS_SELECTOR, "#view-trace .chart")
    labels = [text_of(t) for t in chart.find_elements(By.CSS_SELECTOR, "text.label")]
    ticks = [text_of(t) for t in chart.find_elements(By.CSS_SELECTOR, "text.tick")]
    assert labels == ["step", "energy"] and "0" in ticks and len(ticks) >= 5
    points = chart.find_elements(By.CSS_SELECTOR, "circle[data-step]")
    assert len(points) == len(trace)
    stroke = {int(p.get_attribute("data-step")): p.value_of_css_property("stroke") for p in points}
    best, worst = int(torch.argmin(trace.ranks)), int(torch.argmax(trace.ranks))
    assert int(trace.ranks[best]) == 1 and int(trace.ranks[worst]) > 10
    assert stroke[best] == "rgb(46, 157, 79)" and stroke[worst] == "rgb(208, 66, 58)"
    ActionChains(browser).move_to_element(points[3]).click().perform()
    assert details(browser).get_attribute("data-step") == "3"


def test_a_continuous_colour_scale_and_a_visible_shared_edge(browser, page, trace):
    open_page(browser, page)
    shared = next(i for i, s in enumerate(trace.steps()) if not s.real_edge)
    c = chip(browser, shared)
    assert c.value_of_css_property("border-top-style") == "dashed"
    assert c.value_of_css_property("border-top-width") == "2px"
    assert "repeating-linear-gradient" in c.value_of_css_property("background-image")
    Select(browser.find_element(By.ID, "colours")).select_by_value("continuous")
    by_rank = {}
    for r, shade in zip(trace.ranks.tolist(), backgrounds(browser)):
        by_rank.setdefault(r, set()).add(shade)
    assert all(len(s) == 1 for s in by_rank.values()) and len({next(iter(s)) for s in by_rank.values()}) > 3
    Select(browser.find_element(By.ID, "colours")).select_by_value("buckets")
    buckets = {1: "rgb(217, 242, 223)", 2: "rgb(255, 241, 201)", 11: "rgb(251, 218, 218)"}
    assert backgrounds(browser) == [buckets[1 if r == 1 else 2 if r <= 10 else 11] for r in trace.ranks.tolist()]


def backgrounds(browser) -> list[str]:
    """Every step chip's background colour, in one round trip."""
    return browser.execute_script(
        "return Array.prototype.map.call(document.querySelectorAll('#view-trace .strip .step[data-step]'),"
        " function (c) { return getComputedStyle(c).backgroundColor; });")


def test_arrow_keys_step_through_the_path(browser, page, trace):
    open_page(browser, page)
    chip(browser, 4).click()
    body = browser.find_element(By.TAG_NAME, "body")
    body.send_keys(Keys.ARROW_RIGHT)
    body.send_keys(Keys.ARROW_RIGHT)
    assert details(browser).get_attribute("data-step") == "6" and "selected" in chip(browser, 6).get_attribute("class")
    body.send_keys(Keys.ARROW_LEFT)
    assert details(browser).get_attribute("data-step") == "5"
    for _ in range(len(trace) + 2):
        body.send_keys(Keys.ARROW_RIGHT)
    assert details(browser).get_attribute("data-step") == str(len(trace) - 1)  # it stops at the last step


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
    for c, step in zip(shown, path):
        assert text_of(c.find_element(By.CLASS_NAME, "tok")) == label(step.token_text)
        assert shown_energy(c.find_element(By.CLASS_NAME, "e")) == pytest.approx(step.energy, abs=6e-4)
    shown[-1].click()
    rows = details(browser, "generation").find_elements(By.CSS_SELECTOR, "table.alts tr.alt")
    assert [text_of(r.find_element(By.CLASS_NAME, "tok")) for r in rows] == list(map(label, path[-1].alternative_texts))
    assert field(browser, "rank", "generation") == f"{path[-1].rank} of {model.config.vocab_size}"
    continuation = tokenizer.decode(out.sequences[0], skip_special_tokens=True)
    assert text_of(browser.find_element(By.CSS_SELECTOR, "#view-generation .prose")) == "<s>" + continuation


def test_the_generation_view_folds_a_long_prompt(browser, tiny, tmp_path):
    model, tokenizer = tiny
    prompt = "the cat sat on the mat and the dog sat on the log"
    n = len(tokenizer(prompt)["input_ids"])
    path = tmp_path / "long.html"
    explore(model, prompt=prompt, tokenizer=tokenizer, max_new_tokens=5).save(path)
    open_page(browser, path)
    view = browser.find_element(By.ID, "view-generation")
    assert view.is_displayed()
    assert len(view.find_elements(By.CSS_SELECTOR, ".prose .w.context")) == 24  # the prompt's last 24 tokens
    assert f"{n - 24} earlier prompt tokens" in text_of(view.find_element(By.CSS_SELECTOR, ".prose .fold"))
    assert len(view.find_elements(By.CSS_SELECTOR, ".strip .step.prompt:not(.fold)")) == 3
    view.find_element(By.CSS_SELECTOR, ".strip .step.fold").click()
    assert len(view.find_elements(By.CSS_SELECTOR, ".strip .step.prompt")) == n
    assert text_of(view.find_element(By.CSS_SELECTOR, ".prose")).startswith("\u25be fold the prompt<s>" + prompt)


def test_a_node_view_shows_real_edges_apart_from_the_tied_shared_edge(browser, page, tiny, trace):
    model, tokenizer = tiny
    open_page(browser, page)
    chip(browser, 1).click()  # the signal sits on 't' of "the"
    details(browser).find_element(By.CSS_SELECTOR, '[data-field="source"] a').click()
    assert browser.find_element(By.ID, "view-node").is_displayed()
    node = int(trace.tokens[1])
    box = browser.find_element(By.CSS_SELECTOR, "#view-node .details")
    assert box.get_attribute("data-node") == str(node)
    data = explore(model, TEXT, tokenizer, prompt="the dog", max_new_tokens=12).data["nodes"][str(node)]
    rows = box.find_elements(By.CSS_SELECTOR, "table.edges tr.edge")
    assert [int(r.get_attribute("data-token")) for r in rows] == [v for v, _, _ in data["real"]]
    assert {int(r.get_attribute("data-token")) for r in rows} <= successors(model, node)  # real edges only
    assert [shown_energy(r.find_element(By.CLASS_NAME, "e")) for r in rows] == pytest.approx(
        [e for _, e, _ in data["real"]], abs=6e-4)
    assert [int(text_of(r.find_element(By.CLASS_NAME, "rank"))) for r in rows] == [r for _, _, r in data["real"]]
    tie = box.find_element(By.CSS_SELECTOR, "table.shared-edge tr.tie")
    assert text_of(tie.find_element(By.CLASS_NAME, "count")) == f"{data['shared'][0][1]} nodes tie"
    assert [text_of(h) for h in box.find_elements(By.CSS_SELECTOR, "table.edges thead th")][:3] == [
        "#", "target", "mean energy"]
    assert f"mean over {data['count']} visits" in text_of(box)
    picked = Select(browser.find_element(By.CSS_SELECTOR, "#view-node .pick")).first_selected_option
    assert f"{data['count']} visits" in text_of(picked)
    target = int(rows[0].get_attribute("data-token"))
    rows[0].find_element(By.CSS_SELECTOR, "a.node").click()  # every token is a link to its node
    assert browser.find_element(By.CSS_SELECTOR, "#view-node .details").get_attribute("data-node") == str(target)
    Select(browser.find_element(By.CSS_SELECTOR, "#view-node .pick")).select_by_value(str(node))
    visit = browser.find_element(By.CSS_SELECTOR, "#view-node .visits a.steplink")  # where the signal sat on it
    step, view = visit.get_attribute("data-step"), visit.get_attribute("data-view")
    visit.click()
    assert details(browser, view).get_attribute("data-step") == step and trace.steps()[int(step)].source == node


def test_characters_of_several_byte_tokens_are_shown_whole(browser, tmp_path):
    model, tokenizer = byte_model()
    text = " ".join(WORLD)
    path = tmp_path / "world.html"
    page = explore(model, text, tokenizer)
    page.save(path)
    open_page(browser, path)
    assert text_of(browser.find_element(By.CSS_SELECTOR, "#view-trace .prose")) == "<s>" + prose(text)
    assert "returns" in text_of(browser.find_element(By.CSS_SELECTOR, "#view-trace .prose"))
    groups = browser.find_elements(By.CSS_SELECTOR, "#view-trace .strip .group")
    expected = page.data["paths"][0]["groups"]
    assert [text_of(g.find_element(By.CLASS_NAME, "char")) for g in groups] == [g[2] for g in expected]
    assert {"\u4e2d", "\U0001f600", "\u2423\U0001f600"} & {g[2] for g in expected}
    assert "\ufffd" not in text_of(browser.find_element(By.ID, "view-trace"))
    texts, ids = TokenText(tokenizer), page.data["paths"][0]["tokens"]
    first, last = expected[0][:2]
    pieces = groups[0].find_elements(By.CSS_SELECTOR, ".step[data-step]")
    assert [text_of(p.find_element(By.CLASS_NAME, "tok")) for p in pieces] == [
        label(texts.text(t)) for t in ids[max(first, 1):last + 1]]
    piece = next(t for t in range(max(first, 1), last + 1) if not texts.whole(ids[t]))
    chip(browser, piece - 1).click()
    assert field(browser, "bytes") == texts.bytes(ids[piece]).hex(" ")
    assert field(browser, "character").startswith(expected[0][2])


def test_the_released_chinese_vocabulary_reads_as_characters(browser, tmp_path):
    model, tokenizer = release_chinese()
    text = "\u4e2d\u56fd\u7684\u5927\u5b66\u662f\u4e00\u4e2a\u5730\u65b9"
    path = tmp_path / "zh.html"
    explore(model, text, tokenizer).save(path)
    open_page(browser, path)
    assert text_of(browser.find_element(By.CSS_SELECTOR, "#view-trace .prose")) == text
    assert [text_of(c.find_element(By.CLASS_NAME, "tok")) for c in chips(browser)] == list(text[1:])


def test_a_diff_page_shows_both_models_step_by_step(browser, tiny, tmp_path):
    model, tokenizer = tiny
    other = tricky_model()[0]
    with torch.no_grad():
        other.brillm.weights.mul_(1.5)
    text = "the cat sat on the mat"
    path = tmp_path / "diff.html"
    page = compare(model, other, text, tokenizer, names=["before", "after"])
    page.save(path)
    a, b = (energy_trace(m, text, tokenizer) for m in (model, other))
    open_page(browser, path)
    assert browser.find_element(By.ID, "view-diff").is_displayed()
    ppl = browser.find_elements(By.CSS_SELECTOR, '.diffsum td[data-metric="perplexity"]')
    assert [float(text_of(c)) for c in ppl] == pytest.approx([a.perplexity, b.perplexity], abs=6e-4)
    rows = browser.find_elements(By.CSS_SELECTOR, "table.changed tr.changed-step")
    change = [abs(math.log(rb / ra)) for ra, rb in zip(a.ranks.tolist(), b.ranks.tolist())]
    assert [int(r.get_attribute("data-step")) for r in rows] == page.data["diff"]["changed"]
    assert [change[int(r.get_attribute("data-step"))] for r in rows] == sorted(
        [c for c in change if c > 0], reverse=True)[:10]
    i = int(rows[-1].get_attribute("data-step"))
    rows[-1].click()
    box = details(browser, "diff")
    assert box.get_attribute("data-step") == str(i)
    assert [field(browser, f"rank-{k}", "diff") for k in "ab"] == [f"{int(t.ranks[i])} of 32" for t in (a, b)]
    assert [float(field(browser, f"energy-{k}", "diff")) for k in "ab"] == pytest.approx(
        [float(a.energies[i]), float(b.energies[i])], abs=6e-4)
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_LEFT)
    assert box.get_attribute("data-step") == str(max(0, i - 1))
    browser.find_element(By.ID, "tab-b").click()  # the second model's own path view
    assert [shown_energy(c.find_element(By.CLASS_NAME, "e")) for c in chips(browser, "b")] == pytest.approx(
        b.energies.tolist(), abs=6e-4)


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
    page = explore(model, ids)
    page.save(path)
    trace = energy_trace(model, ids, top_k=5)
    start = time.perf_counter()
    open_page(browser, path)
    load_seconds = time.perf_counter() - start
    assert path.stat().st_size < 2_000_000 and load_seconds < 10
    worst = int(torch.argmax(trace.ranks))
    assert details(browser).get_attribute("data-step") == str(worst)  # it opens on the most surprising step
    browser.find_element(By.CSS_SELECTOR, "#view-trace .goto").send_keys("5\n")
    assert [int(c.get_attribute("data-step")) for c in chips(browser)] == list(range(200))
    browser.find_element(By.CSS_SELECTOR, "#view-trace .next").click()
    assert [int(c.get_attribute("data-step")) for c in chips(browser)] == list(range(200, 400))
    assert details(browser).get_attribute("data-step") == "200"  # the pinned step moves onto the page shown
    go = browser.find_element(By.CSS_SELECTOR, "#view-trace .goto")
    go.clear()
    go.send_keys("1500\n")
    assert details(browser).get_attribute("data-step") == "1500"
    assert int(chips(browser)[0].get_attribute("data-step")) == 1400  # the page holding it
    assert float(field(browser, "energy")) == pytest.approx(float(trace.energies[1500]), abs=6e-4)
    assert field(browser, "rank") == f"{int(trace.ranks[1500])} of 4000"
    mix = details(browser).find_elements(By.CSS_SELECTOR, ".mixtable tr")
    weights = mix_weights(model, 1500)
    assert float(mix[0].get_attribute("data-weight")) == pytest.approx(float(weights.max()), abs=1e-7)
    point = browser.find_element(By.CSS_SELECTOR, '#view-trace .chart circle[data-step="1000"]')
    ActionChains(browser).move_to_element(point).click().perform()
    picked = int(details(browser).get_attribute("data-step"))
    assert abs(picked - 1000) <= 1 and int(chips(browser)[0].get_attribute("data-step")) == picked // 200 * 200
    missing = browser.execute_script(
        "var a = Array.prototype.find.call(document.querySelectorAll('#view-trace .details a.node'), function (x) {"
        " return !(x.dataset.node in JSON.parse(document.getElementById('brillm-data').textContent).nodes); });"
        " if (a) { a.click(); return a.dataset.node; } return null;")
    if missing is not None:  # a token whose edges the page does not hold says how to add them
        note = text_of(browser.find_element(By.CSS_SELECTOR, "#view-node .missing"))
        assert f"--node {missing}" in note and f"nodes=[{missing}]" in note
    assert torch.isfinite(trace.energies).all() and len(page.data["nodes"]) <= 2000 + 400
