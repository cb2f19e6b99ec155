"""Growing a trained graph: new nodes (resize_token_embeddings), new edges (add_edges), and a fine-tune of them."""

import pytest
import torch
from _tiny import CORPUS, EOS, PAD, assert_same, corpus_ids, make_model, make_tokenizer, save_tiny

from modeling_brillm import BriLLMForCausalLM

NEW_TEXT = [
    "the fox saw a quick zebra", "a quiet fox and a lazy zebra", "the zebra jumps over the fox",
    "a fox quiz for the zebra", "the quick fox sat on the box", "my zebra likes the quiet fox",
    "a lazy fox and the quick zebra", "the zebra and the fox are quiet", "your fox jumps on the box",
    "a quick quiz for a lazy fox", "the box of the zebra", "a quiet zebra saw the fox jump",
]
NEW_CHARS = ["x", "z", "q", "j", "z" + "e"]  # "ze": a two-character token, so a new node can also span old ones
RECIPE = dict(non_edge_bias=True, node_readout=True, edge_backoff=True, position_recency=0.2)  # the default's options


@pytest.fixture(scope="module")
def trained():
    tokenizer = make_tokenizer()
    return make_model(tokenizer), tokenizer


def old_batch(tokenizer):
    ids = torch.nn.utils.rnn.pad_sequence(corpus_ids(tokenizer), batch_first=True, padding_value=PAD)
    return ids, (ids != PAD).long()


def grown_copy(model):
    copy = BriLLMForCausalLM(model.config.__class__.from_dict(model.config.to_dict()))
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def test_new_nodes_leave_old_logits_exactly(trained, device):
    model, tokenizer = trained
    model, tokenizer = grown_copy(model).to(device), make_tokenizer()
    ids, mask = old_batch(tokenizer)
    V = model.config.vocab_size
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    assert tokenizer.add_tokens(NEW_CHARS) == len(NEW_CHARS)
    assert model.resize_token_embeddings(len(tokenizer)) is None
    assert model.config.vocab_size == len(tokenizer) == V + len(NEW_CHARS)
    base = model.base_model
    assert (base.base_model.graph_indptr.numel() == len(tokenizer) + 1
            and base.base_model.node_bias.shape[0] == len(tokenizer))
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(after[..., :V], before)
    # a new node joins through the shared edge: every old source gives it the shared (non-edge) energy
    shared = after[..., V:]
    assert torch.equal(shared, shared[..., :1].expand_as(shared))
    # text with the new tokens runs, also starting at a new node
    for new_ids in (tokenizer("the zebra quiz").input_ids, [V] + tokenizer("the box").input_ids[1:] + [EOS]):
        assert max(new_ids) >= V
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([new_ids])).logits).all()


def test_new_nodes_leave_the_recipes_logits_exactly(device):
    """The recipe's per-node rows (non-successor offset, readout) grow with the nodes: zero rows, old logits kept."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, **RECIPE).to(device)
    assert model.base_model.node_readout.abs().sum() > 0  # trained: the old rows are not zero
    ids, mask = old_batch(tokenizer)
    V = model.config.vocab_size
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    tokenizer.add_tokens(NEW_CHARS)
    model.resize_token_embeddings(len(tokenizer))
    base = model.base_model
    assert base.non_edge_bias.shape == (len(tokenizer),) and base.node_readout.shape[0] == len(tokenizer)
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(after[..., :V], before)
    new = after[..., V:]
    assert torch.equal(new, new[..., :1].expand_as(new))


def test_new_edges_start_as_the_shared_edge_and_change_nothing(trained, device):
    model, _ = trained
    model, tokenizer = grown_copy(model).to(device), make_tokenizer()
    tokenizer.add_tokens(NEW_CHARS)
    model.resize_token_embeddings(len(tokenizer))
    ids, mask = old_batch(tokenizer)
    new_seqs = [torch.tensor(tokenizer(t).input_ids + [EOS]) for t in NEW_TEXT]
    batch = torch.nn.utils.rnn.pad_sequence(new_seqs, batch_first=True, padding_value=PAD)
    new_mask = (batch != PAD).long()
    E = model.config.num_edges
    with torch.no_grad():
        old_before, new_before = model(ids, attention_mask=mask).logits, model(batch, attention_mask=new_mask).logits
    rows = model.add_edges_from_sequences(new_seqs, ignore_ids=[PAD])
    assert rows.numel() > 10 and model.config.num_edges == E + rows.numel() == model.base_model.weights.shape[0] - 1
    assert torch.equal(model.base_model.weights[rows], model.base_model.weights[:1].expand(rows.numel(), -1, -1))
    assert torch.equal(model.base_model.biases[rows], model.base_model.biases[:1].expand(rows.numel(), -1, -1))
    model.check_graph()
    for before, (x, m) in ((old_before, (ids, mask)), (new_before, (batch, new_mask))):
        with torch.no_grad():
            after = model(x, attention_mask=m).logits
        # a new edge's energy is the shared one it replaces, computed by the real-edge kernel (rounding only);
        # every other logit is bit for bit the same (on the CPU; float32 rounding apart on CUDA)
        V = after.shape[-1]
        edge = model.edge_rows(x.unsqueeze(-1).expand(-1, -1, V).reshape(-1), torch.arange(V).repeat(x.numel()))
        is_new = torch.isin(edge, rows).view_as(after)
        assert_same(after[~is_new], before[~is_new])
        torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)
    # every bigram of the new text is now real, and the rows returned are theirs
    src = torch.cat([s[:-1] for s in new_seqs])
    tgt = torch.cat([s[1:] for s in new_seqs])
    assert bool((model.edge_rows(src, tgt) > 0).all())
    assert model.add_edges_from_sequences(new_seqs).numel() == 0  # nothing left to add
    pairs = torch.tensor([[len(tokenizer) - 1, 5], [5, len(tokenizer) - 1]])
    fresh = model.add_edges(pairs, counts=[7, 9])
    assert torch.equal(model.edge_rows(pairs[:, 0], pairs[:, 1]), fresh)
    assert model.base_model.graph_counts[fresh - 1].tolist() == [7, 9]


def test_bad_growth_input_has_clear_errors(trained, device):
    model, _ = trained
    model = grown_copy(model).to(device)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=f"would drop nodes {V - 2}..{V - 1}.*can only add nodes"):
        model.resize_token_embeddings(V - 2)
    outside = f"pair \\(3, {V}\\) names a node outside \\[0, {V}\\).*resize_token_embeddings"
    with pytest.raises(ValueError, match=outside):
        model.add_edges([(3, V)])
    real = model.base_model.graph_indices[0].item()
    first = int(torch.nonzero(model.base_model.graph_indptr.diff())[0])
    with pytest.raises(ValueError, match=f"already are real edges: \\({first}, {real}\\)"):
        model.add_edges([(first, real)])
    with pytest.raises(ValueError, match="listed more than once"):
        model.add_edges([(0, 0), (0, 0)])
    with pytest.raises(ValueError, match="shape \\(N, 2\\)"):
        model.add_edges(torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer node ids"):
        model.add_edges(torch.zeros(1, 2))
    assert model.config.num_edges == model.base_model.weights.shape[0] - 1  # nothing changed on refusal
    model.resize_token_embeddings(V + 1, pad_to_multiple_of=8)
    assert model.config.vocab_size == -(-(V + 1) // 8) * 8
    dense = make_model(make_tokenizer(), dense=True, node_size=4)
    with pytest.raises(ValueError, match="dense.*every pair u→v already is a real edge"):
        dense.add_edges([(0, 1)])


def test_dense_graph_grows_keeping_old_edges(trained, device):
    tokenizer = make_tokenizer()
    dense = make_model(tokenizer, dense=True, node_size=4).to(device)
    ids, mask = old_batch(tokenizer)
    V = dense.config.vocab_size
    with torch.no_grad():
        before = dense(ids, attention_mask=mask).logits
    dense.resize_token_embeddings(V + 3)
    assert dense.config.num_edges == (V + 3) ** 2 == dense.base_model.weights.shape[0] - 1
    with torch.no_grad():
        assert torch.equal(dense(ids, attention_mask=mask).logits[..., :V], before)


def test_grown_model_saves_and_loads_as_remote_code(trained, tmp_path):
    from test_modeling import run_isolated

    model, _ = trained
    model, tokenizer = grown_copy(model), make_tokenizer()
    tokenizer.add_tokens(NEW_CHARS)
    model.resize_token_embeddings(len(tokenizer))
    model.add_edges_from_sequences([torch.tensor(tokenizer(t).input_ids) for t in NEW_TEXT])
    model.save_pretrained(tmp_path / "saved")
    ids = torch.tensor([tokenizer("the quick zebra").input_ids])
    with torch.no_grad():
        expected = model(ids).logits
    again = BriLLMForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.config.vocab_size == len(tokenizer) and again.config.num_edges == model.config.num_edges
    assert torch.equal(again(ids).logits, expected)
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    out = run_isolated("""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("saved", trust_remote_code=True)
        assert "transformers_modules" in type(model).__module__
        expected = torch.load("expected.pt")
        assert torch.equal(model(expected["ids"]).logits, expected["logits"])
        print("ok")
    """, tmp_path)
    assert "ok" in out


@pytest.mark.parametrize("options", [{}, RECIPE], ids=["release", "recipe"])
def test_fine_tune_teaches_new_tokens_and_keeps_old_text(tmp_path, options):
    """What examples/grow_graph.py runs, on a tiny model: the directions the README reports on the demo."""
    from modeling_brillm.training.growing import main

    save_tiny(tmp_path / "tiny", **options)
    (tmp_path / "new.txt").write_text("\n".join(NEW_TEXT) + "\n")
    (tmp_path / "old.txt").write_text("\n".join(CORPUS) + "\n")
    r = main(["--model", str(tmp_path / "tiny"), "--output_dir", str(tmp_path / "grown"), "--new_text",
              str(tmp_path / "new.txt"), "--old_text", str(tmp_path / "old.txt"), "--old_train_text",
              str(tmp_path / "old.txt"), "--replay", "10", "--add_tokens", *NEW_CHARS[:4], "--steps", "40",
              "--lr", "0.02",
              "--max_length", "64"])
    assert r["nodes_exact"] and r["edges_exact"] and r["edges_max_diff"] < 1e-5 and r["old_rows_unchanged"]
    assert r["ppl_new_tokens_held"][1] < 0.5 * r["ppl_new_tokens_held"][0]
    assert r["ppl_new_train"][1] < r["ppl_new_train"][0]
    assert abs(r["old_change"]) < 0.05
    assert r["reload_ok"] and r["remote_ok"]


def test_grow_graph_splits_the_demos_text_like_pretraining():
    """Without --old_text the example reads the demo's own split of the built-in corpus."""
    from modeling_brillm.training.growing import builtin_old_text

    validation, training = builtin_old_text()
    assert validation and len(training) > 10 * len(validation)
    assert len(set(validation) - set(training)) > 0.5 * len(set(validation))  # other paragraphs, mostly new text
