"""The explorer's page data (modeling_brillm/explorer): what it embeds is what energy_trace, energy_generate, the
model's graph and its recurrence say; the Node view ranks real edges apart from the shared edge and counts every
visit once; the page escapes every token; a diff page is both models' traces; bad input gets a one-line message."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _pages import TEXT, TRICKY, big_model, successors, tricky_model
from _tiny import make_tokenizer, save_tiny

from modeling_brillm import energy_generate, energy_trace
from modeling_brillm.explorer import Explorer, TooLong, compare, explore, label, load_model, mix_weights, neighbourhoods

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return tricky_model()


@pytest.fixture(scope="module")
def page(tiny):
    model, tokenizer = tiny
    return explore(model, TEXT, tokenizer, prompt="the dog", max_new_tokens=12, nodes=["y"])


def embedded(html: str) -> dict:
    """The JSON a written page carries, read back the way the page's script reads it."""
    payload = re.search(r'<script type="application/json" id="brillm-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(payload)


def test_the_trace_view_is_energy_trace(tiny, page):
    model, tokenizer = tiny
    trace = energy_trace(model, TEXT, tokenizer, top_k=5)
    path = page.data["paths"][0]
    assert path["kind"] == "trace" and path["tokens"] == trace.tokens.tolist()
    assert len(path["steps"]) == len(trace) == len(trace.tokens) - 1
    for got, step in zip(path["steps"], trace.steps()):
        assert (got["i"], got["src"], got["tgt"], got["rank"], got["pred"], got["real"]) == (
            step.position, step.source, step.target, step.rank, step.predicted, step.real_edge)
        assert got["e"] == pytest.approx(step.energy, rel=1e-5)
        assert got["p"] == pytest.approx(step.probability, rel=1e-5)
        assert [a for a, _ in got["alts"]] == [a for a, _ in step.alternatives]
        assert [e for _, e in got["alts"]] == pytest.approx([e for _, e in step.alternatives], rel=1e-5)
    assert not all(s["real"] for s in path["steps"])  # the added tokens are reached through the shared edge
    labels = page.data["labels"]
    for token, text in zip(trace.tokens.tolist(), trace.token_texts):
        assert labels[str(token)] == label(text)
    assert page.data["title"] == "BriLLM explorer: BriLLM"  # a model built in memory has no folder name


def test_the_generation_view_is_energy_generate(tiny, page):
    model, tokenizer = tiny
    prompt = tokenizer("the dog", return_tensors="pt")["input_ids"]
    out = energy_generate(model, prompt, max_new_tokens=12, num_alternatives=5)
    path = page.data["paths"][1]
    assert path["kind"] == "generation" and path["prompt_length"] == prompt.shape[1]
    assert path["tokens"] == out.sequences[0].tolist()[: prompt.shape[1] + len(path["steps"])]
    for got, step in zip(path["steps"], out.path(0)):
        assert (got["src"], got["tgt"], got["rank"]) == (step.source, step.token, step.rank)
        assert got["i"] == step.position - 1
        assert got["e"] == pytest.approx(step.energy, rel=1e-5)
        assert [a for a, _ in got["alts"]] == [a for a, _ in step.alternatives]
        assert got["real"] == (step.token in successors(model, step.source))
    assert len(path["steps"]) == len(out.path(0)) >= 1


def test_mix_weights_rebuild_the_models_signal(tiny):
    """x_i = sum_k w_k c_k with the edge outputs c_k recomputed from the edge tables: the weights the page shows are
    the ones the recurrence mixes with."""
    model, tokenizer = tiny
    ids = torch.tensor(tokenizer("the cat sat on the mat")["input_ids"])
    base = model.brillm
    with torch.no_grad():
        x = base.run_signals(ids.unsqueeze(0)).signals[0]
        rows = model.edge_rows(ids[:-1], ids[1:])
        pe = base.position_encoding(torch.arange(1, len(ids)))
        c = F.gelu(torch.einsum("kd,kde->ke", x[:-1], base.weights[rows]) + base.biases[rows, 0] + pe)
    assert mix_weights(model, 0).numel() == 0
    for i in range(1, len(ids)):
        w = mix_weights(model, i)
        assert w.sum() == pytest.approx(1.0, abs=1e-6) and (i == 1 or float(w.max() - w.min()) > 1e-3)
        torch.testing.assert_close(w @ c[:i], x[i], rtol=1e-5, atol=1e-5)
    logits = base.positions.view(-1)[:5].detach()
    assert page_mix(explore(model, [2, 5, 6]).data["positions"], 5) == pytest.approx(
        torch.softmax(logits, 0).tolist(), rel=1e-5)


def page_mix(positions, i):
    """The page script's mixWeights, in Python: softmax of the logits of the edges entering tokens 1..i."""
    logits = torch.tensor([positions[min(k - 1, len(positions) - 1)] for k in range(1, i + 1)])
    return torch.softmax(logits, 0).tolist()


def visit_rows(model, node, trace_ids, gen_ids):
    """Every energy row of a visit to `node`, each position once: the continuation's positions that repeat the
    text's own prefix are the same visits."""
    same = 0
    while same < min(len(trace_ids), len(gen_ids)) and trace_ids[same] == gen_ids[same]:
        same += 1
    with torch.no_grad():
        a, b = (model(torch.tensor([p])).logits[0] for p in (trace_ids, gen_ids))
    rows = [a[t] for t, u in enumerate(trace_ids) if u == node] + [
        b[t] for t, u in enumerate(gen_ids) if u == node and t >= same]
    return torch.stack(rows)


def test_a_nodes_real_edges_are_ranked_apart_from_the_shared_edge(tiny, page):
    model, tokenizer = tiny
    trace_ids, gen_ids = (p["tokens"] for p in page.data["paths"])
    assert trace_ids[:5] == gen_ids[:5] and trace_ids[5] != gen_ids[5]  # "<s>the " is read by both paths
    for node in (tokenizer.convert_tokens_to_ids("t"), tokenizer.convert_tokens_to_ids(" ")):
        rows = visit_rows(model, node, trace_ids, gen_ids)
        hood = page.data["nodes"][str(node)]
        assert hood["count"] == rows.shape[0] >= 2
        mean, real = rows.mean(0), sorted(successors(model, node))
        assert hood["degree"] == len(real) and "mean over" in hood["measure"]
        top = torch.topk(mean[real], min(10, len(real)))
        assert [v for v, _, _ in hood["real"]] == [real[i] for i in top.indices.tolist()]
        assert [e for _, e, _ in hood["real"]] == pytest.approx(top.values.tolist(), rel=1e-5)
        assert [r for _, _, r in hood["real"]] == [1 + int((mean > e).sum()) for e in top.values]
        others = torch.tensor([v for v in range(len(mean)) if v not in set(real)])
        best = mean[others].max()
        energy, ties, rank, examples = hood["shared"][0]
        assert energy == pytest.approx(float(best), rel=1e-5) and rank == 1 + int((mean > best).sum())
        assert ties == int((mean[others] == best).sum()) > 1  # the shared edge's targets tie: one row says so
        assert all(v not in real and float(mean[v]) == float(best) for v in examples)


def test_visits_are_counted_once_when_the_continuation_holds_its_prompt(tiny):
    """The command line and the app trace a text and continue the same text: the prompt's positions are the
    trace's, so a node in the prompt counts as many visits as the text holds it."""
    model, tokenizer = tiny
    text = "the cat sat on"
    page = explore(model, text, tokenizer, prompt=text, max_new_tokens=6)
    trace_ids, gen_ids = (p["tokens"] for p in page.data["paths"])
    assert gen_ids[:len(trace_ids)] == trace_ids
    for node in set(gen_ids):
        assert page.data["nodes"][str(node)]["count"] == gen_ids.count(node)


def test_nodes_the_tables_lead_to_have_their_own_edges(tiny, page):
    model, tokenizer = tiny
    nodes = page.data["nodes"]
    led = {v for h in nodes.values() for v in [e[0] for e in h["real"]] + [x for s in h["shared"] for x in s[3]]}
    assert led <= set(map(int, nodes))  # every token the Node view shows opens a node with its edges
    z = next(u for u in map(int, nodes) if nodes[str(u)]["count"] == 0 and u != page.data["focus"])
    after = model(torch.tensor([[tokenizer.bos_token_id, z]])).logits[0, -1]
    real = sorted(successors(model, z))
    assert "<BOS> u" in nodes[str(z)]["measure"]
    if real:
        assert nodes[str(z)]["real"][0][0] == real[int(torch.argmax(after[real]))]
    assert page.data["focus"] == tokenizer.convert_tokens_to_ids("y")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        neighbourhoods(model, [], [10**6])


def test_the_page_embeds_tokens_as_data_not_markup(tiny, page, tmp_path):
    html = page.to_html()
    assert "<script>window.pwned" not in html and "<img src=x" not in html  # only escaped inside the JSON
    assert html.count("<script") == 2 and html.count("</script>") == 2  # the data and the page's own script
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html  # no network
    assert embedded(html) == json.loads(json.dumps(page.data))
    labels = set(embedded(html)["labels"].values())
    assert {TRICKY[0], TRICKY[1], TRICKY[2], "\\u202eevil", "\u21e5", "\u21b5", "\u2407"} <= labels
    saved = page.save(tmp_path / "sub" / "page.html")
    assert Path(saved).read_text(encoding="utf-8") == html
    frame = page._repr_html_()  # the notebook view: the page in a sandboxed iframe, quotes escaped
    assert frame.startswith('<iframe class="brillm-explorer" sandbox="allow-scripts"') and "<script" not in frame
    sources = [p.read_text() for p in (ROOT / "modeling_brillm" / "explorer").rglob("*.py")]
    assert sources and not any("import IPython" in s for s in sources)


def test_the_explorer_is_no_part_of_a_saved_models_code(tmp_path):
    """Nothing under modeling_brillm/ but the explorer itself (and the package's __init__) imports it, so a saved
    folder's remote code never holds it."""
    package = ROOT / "modeling_brillm"
    importing = [str(p.relative_to(package)) for p in package.rglob("*.py") if "explorer" not in p.parts and
                 re.search(r"^\s*(from\s+\S*explorer|import\s+\S*explorer)", p.read_text(), re.M)]
    assert importing == []
    save_tiny(tmp_path / "model")
    assert not any("explorer" in p.name for p in (tmp_path / "model").iterdir())


def test_a_diff_page_is_both_models_traces(tiny):
    model, tokenizer = tiny
    other = tricky_model()[0]
    with torch.no_grad():  # a second model: the same graph, the edges' matrices moved
        other.brillm.weights.mul_(1.5)
    text = "the cat sat on the mat"
    page = compare(model, other, text, tokenizer, names=["before", "after"])
    a, b = (energy_trace(m, text, tokenizer, top_k=5) for m in (model, other))
    first, second = page.data["paths"]
    assert page.data["diff"]["names"] == ["before", "after"]
    assert page.data["title"] == "BriLLM diff: before \u2192 after"
    for path, trace in ((first, a), (second, b)):
        assert [s["rank"] for s in path["steps"]] == trace.ranks.tolist()
        assert [s["e"] for s in path["steps"]] == pytest.approx(trace.energies.tolist(), rel=1e-5)
        assert path["summary"]["perplexity"] == pytest.approx(trace.perplexity, rel=1e-5)
    change = [abs(math.log(rb / ra)) for ra, rb in zip(a.ranks.tolist(), b.ranks.tolist())]
    expected = sorted((i for i in range(len(change)) if change[i] > 0), key=lambda i: (-change[i], i))[:10]
    assert page.data["diff"]["changed"] == expected and expected
    changed = make_tokenizer()  # one more token: it reads "the" as one token where the original reads three
    changed.add_tokens(["the"])
    with pytest.raises(ValueError, match="different tokens"):
        compare(model, other, text, tokenizer, changed)


def test_bad_input_gets_a_one_line_message(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.chdir(tmp_path.parent)
    cases = [
        (lambda: explore(model, "", tokenizer), "the text is empty"),
        (lambda: explore(model), "nothing to show"),
        (lambda: explore(model, [5], tokenizer), "the text makes 1 token and a trace needs two"),
        (lambda: explore(model, "a" * 80, tokenizer), r"holds 81 tokens, more than the 64 positions .*extend=True"),
        (lambda: explore(model, prompt="the", max_new_tokens=70, tokenizer=tokenizer), "position 74, past the 64"),
        (lambda: explore(model, prompt="the", max_new_tokens=-3, tokenizer=tokenizer), "0 or more, got -3"),
        (lambda: explore(model, "the cat", tokenizer, nodes=["cat"]), "not one token"),
        (lambda: explore(model, "the cat", tokenizer, nodes=["Q"]), "not in the vocabulary"),
        (lambda: load_model(""), "no model given"),
        (lambda: load_model(str(tmp_path)), "is not a BriLLM model folder"),
        (lambda: load_model(str(tmp_path / "missing" / "model")), "no such folder"),
        (lambda: load_model("../mistyped"), "no such folder"),
        (lambda: load_model(f"{tmp_path.name}/dmeo"), "no such folder"),  # a folder here: a path, not a Hub id
    ]
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    cases += [(lambda: load_model(str(tmp_path / "gpt")), "holds a 'gpt2' model, not a BriLLM"),
              (lambda: load_model(str(tmp_path / "weights.bin")), "is a file, not a model folder")]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value) and ".;" not in str(error.value)
    with pytest.raises(TooLong) as error:
        explore(model, "a" * 80, tokenizer)
    assert error.value.problem == "the text holds 81 tokens, more than the 64 positions this model was trained on"
    page = Explorer.error("the text is <empty>")
    assert embedded(page.to_html()) == {"title": "BriLLM explorer", "error": "the text is <empty>"}


def test_a_saved_folder_is_titled_by_its_name_and_loads_quietly(tmp_path, capfd):
    save_tiny(tmp_path / "my-model")
    capfd.readouterr()
    model, tokenizer = load_model(str(tmp_path / "my-model"))
    page = explore(model, "the cat", tokenizer)
    assert page.data["title"] == "BriLLM explorer: my-model" and page.data["model"]["name"] == "my-model"
    assert str(tmp_path) not in json.dumps(page.data)  # the server's path stays off the page
    out, err = capfd.readouterr()
    assert out == err == ""  # no progress bar, no warning


def test_a_2000_token_text_over_4000_nodes_stays_small():
    model, ids = big_model()
    start = time.perf_counter()
    page = explore(model, ids, top_k=5)
    seconds = time.perf_counter() - start
    html = page.to_html()
    path = page.data["paths"][0]
    assert len(path["steps"]) == 1999 and page.data["model"]["vocab_size"] == 4000
    trace = energy_trace(model, ids, top_k=5)
    assert [s["rank"] for s in path["steps"]] == trace.ranks.tolist()
    assert len(html.encode()) < 2_000_000, len(html)
    assert seconds < 60
