"""The explorer's page data (modeling_brillm/explorer.py): what it embeds is what energy_trace, energy_generate and
the model's recurrence say; the page escapes every token; bad input gets a one-line message."""

from __future__ import annotations

import json
import re
import runpy
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _pages import TEXT, TRICKY, big_model, tricky_model
from _tiny import save_tiny

from modeling_brillm.decoding import energy_generate
from modeling_brillm.explorer import Explorer, explore, label, load_model, mix_weights, neighbourhoods
from modeling_brillm.interpretability import energy_trace

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
    assert page_mix(embedded_positions(model), 5) == pytest.approx(torch.softmax(logits, 0).tolist(), rel=1e-5)


def embedded_positions(model):
    return explore(model, [2, 5, 6]).data["positions"]


def page_mix(positions, i):
    """The page script's mixWeights, in Python: softmax of the logits of the edges entering tokens 1..i."""
    logits = torch.tensor([positions[min(k - 1, len(positions) - 1)] for k in range(1, i + 1)])
    return torch.softmax(logits, 0).tolist()


def test_a_nodes_neighbourhood_is_its_mean_energy_over_its_visits(tiny, page):
    model, tokenizer = tiny
    trace_ids, gen_ids = (p["tokens"] for p in page.data["paths"])
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0] for p in (trace_ids, gen_ids)]
    node = tokenizer.convert_tokens_to_ids("t")
    rows = torch.cat([lg[torch.tensor(p) == node] for lg, p in zip(logits, (trace_ids, gen_ids))])
    hood = page.data["nodes"][str(node)]
    assert hood["count"] == rows.shape[0] >= 2
    top = torch.topk(rows.mean(0), 10)
    assert [v for v, _, _ in hood["edges"]] == top.indices.tolist()
    assert [e for _, e, _ in hood["edges"]] == pytest.approx(top.values.tolist(), rel=1e-5)
    real = (model.edge_rows(torch.full((10,), node), top.indices) != 0).tolist()
    assert [r for _, _, r in hood["edges"]] == real and any(real)
    indptr, _ = model.csr()
    assert hood["degree"] == int(indptr[node + 1] - indptr[node])
    assert page.data["focus"] == tokenizer.convert_tokens_to_ids("y")
    # a node no text visits: the energies after <BOS> u
    z = next(u for u in range(len(tokenizer)) if u not in trace_ids + gen_ids)
    hood = neighbourhoods(model, [trace_ids], [z], 4, tokenizer.bos_token_id)[z]
    after = model(torch.tensor([[tokenizer.bos_token_id, z]])).logits[0, -1]
    assert hood["count"] == 0 and "<BOS> u" in hood["measure"]
    assert [v for v, _, _ in hood["edges"]] == torch.topk(after, 4).indices.tolist()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        neighbourhoods(model, [], [10**6])


def test_labels_show_every_character():
    assert label(" ") == "\u2423" and label("  ") == "\u2423\u2423" and label(" the") == " the"
    assert label("a\nb\tc\r") == "a\u21b5b\u21e5c\u240d" and label("\x07") == "\u2407" and label("\x7f") == "\u2421"
    assert label("\u202eevil") == "\\u202eevil" and label("zero\u200bwidth") == "zero\\u200bwidth"
    assert label("") == "\u2205" and label(None, 42) == "#42" and label("<b>") == "<b>"


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
    assert "import IPython" not in (ROOT / "modeling_brillm" / "explorer.py").read_text()


def test_bad_input_gets_a_one_line_message(tiny, tmp_path):
    model, tokenizer = tiny
    cases = [
        (lambda: explore(model, "", tokenizer), "the text is empty"),
        (lambda: explore(model), "nothing to show"),
        (lambda: explore(model, "a" * 80, tokenizer), r"more than max_position_embeddings=64"),
        (lambda: explore(model, prompt="the", max_new_tokens=70, tokenizer=tokenizer), "max_position_embeddings=64"),
        (lambda: explore(model, "the cat", tokenizer, nodes=["cat"]), "not one token"),
        (lambda: explore(model, "the cat", tokenizer, nodes=["Q"]), "not in the vocabulary"),
        (lambda: load_model(""), "no model given"),
        (lambda: load_model(str(tmp_path)), "is not a BriLLM model folder"),
    ]
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    cases.append((lambda: load_model(str(tmp_path / "gpt")), "holds a 'gpt2' model, not a BriLLM"))
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value)
    page = Explorer.error("the text is <empty>")
    assert embedded(page.to_html()) == {"title": "BriLLM explorer", "error": "the text is <empty>"}


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


def test_visualize_writes_the_page(tmp_path, capsys):
    save_tiny(tmp_path / "model")
    main = runpy.run_path(str(ROOT / "examples" / "visualize.py"))["main"]
    out = tmp_path / "page.html"
    args = ["--model", str(tmp_path / "model"), "--text", "the cat sat", "--html", str(out)]
    assert main(args + ["--generate", "5", "--node", "d"]) == 0
    assert "wrote " + str(out) in capsys.readouterr().out
    data = embedded(out.read_text(encoding="utf-8"))
    assert [p["kind"] for p in data["paths"]] == ["trace", "generation"] and len(data["paths"][1]["steps"]) == 5
    assert data["labels"][str(data["focus"])] == "d"
    long = ["--model", str(tmp_path / "model"), "--text", "the cat " * 10, "--html", str(out)]
    assert main(long) == 2
    assert "pass --extend" in capsys.readouterr().err
    assert main(long + ["--extend"]) == 0
    assert main(["--model", str(tmp_path), "--text", "the", "--html", str(out)]) == 2
    assert "is not a BriLLM model folder" in capsys.readouterr().err


def test_browser_tests_fail_under_ci_rather_than_skip(monkeypatch):
    from _browser import missing

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        missing("chromium")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="need chromium"):
        missing("chromium")
