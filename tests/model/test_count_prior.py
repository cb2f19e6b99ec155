"""The count prior (`config.count_prior`): a fixed smoothed bigram model of the training text that every logit adds.
It is the interpolated absolute-discount model of every seen bigram; the logits, the loss, every decoding path, a
saved folder and a grown graph carry it; the setups that cannot add it refuse it clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM, build_sparse_graph
from modeling_brillm.count_prior import add_count_prior
from modeling_brillm.graph import count_bigrams, count_prior
from tests._tiny import PAD, assert_decodes_like_forward, corpus_ids, make_model, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def kneser_ney(sequences, V, D=0.75):
    """The model written out densely: max(c − D, 0)/c(u) + D·types(u)/c(u)·p_uni, p_uni the add-one unigram of the
    targets; an unseen source gets p_uni."""
    c = torch.zeros(V, V, dtype=torch.float64)
    for s in sequences:
        for u, v in zip(s[:-1].tolist(), s[1:].tolist()):
            c[u, v] += 1
    total = c.sum(1, keepdim=True)
    unigram = (c.sum(0) + 1) / (c.sum() + V)
    p = (c - D).clamp_min(0) / total.clamp_min(1) + D * (c > 0).sum(1, keepdim=True) / total.clamp_min(1) * unigram
    return torch.where(total > 0, p, unigram.expand(V, V))


def with_prior(base, sequences):
    """`base`'s weights in a model that also adds the count prior of `sequences`."""
    V = base.config.vocab_size
    prior = count_prior(*count_bigrams(sequences, V), V)
    model = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), "count_prior": True,
                                              "count_prior_bigrams": prior.num_bigrams}))
    model.load_state_dict(base.state_dict(), strict=False)
    model.set_count_prior(prior)
    return model.eval(), prior


def padded(tok):
    seqs = corpus_ids(tok)
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    return ids, mask


def test_the_prior_is_the_smoothed_bigram_model(tok):
    """Row u of the stored prior is log p(·|u) up to one constant: its softmax is the model, which sums to one."""
    seqs = corpus_ids(tok)
    V = len(tok) + 3  # nodes no bigram names: their rows are the unigram
    prior = count_prior(*count_bigrams(seqs, V), V)
    expected = kneser_ney(seqs, V)
    torch.testing.assert_close(expected.sum(1), torch.ones(V, dtype=torch.float64))
    torch.testing.assert_close(torch.softmax(prior.table().double(), 1), expected, rtol=1e-5, atol=1e-7)
    keys, _ = count_bigrams(seqs, V)
    assert prior.num_bigrams == keys.numel()
    with pytest.raises(ValueError, match=r"discount must be in \(0, 1\]"):
        count_prior(*count_bigrams(seqs, V), V, discount=1.5)


def test_adding_it_reads_each_row_of_the_csr(tok):
    """The fixed-shape add (padded to the largest degree) equals adding the dense table's rows."""
    seqs = corpus_ids(tok)
    V = len(tok)
    prior = count_prior(*count_bigrams(seqs, V), V)
    sources = torch.tensor([0, 5, 5, V - 1, 2])
    logits = torch.randn(5, V)
    degree = int(prior.indptr.diff().max())
    got = add_count_prior(logits, sources, prior.node, prior.indptr, prior.indices, prior.values, degree)
    torch.testing.assert_close(got, logits + prior.table()[sources])


@pytest.mark.parametrize("readout", [False, True])
def test_logits_add_the_prior_and_the_loss_is_their_cross_entropy(tok, readout, device):
    base = make_model(tok, node_size=6, seed=2, non_edge_bias=True, node_readout=readout)
    ids, mask = padded(tok)
    ref = base(ids, attention_mask=mask)
    model, prior = with_prior(base, corpus_ids(tok))
    out = model.to(device)(ids, attention_mask=mask, labels=ids)
    real = mask.bool()
    logits = out.logits.cpu()
    torch.testing.assert_close(logits[real], (ref.logits + prior.table()[ids])[real], rtol=1e-5, atol=1e-5)
    scored = real[:, 1:]
    ce = F.cross_entropy(logits[:, :-1][scored], ids[:, 1:][scored])
    torch.testing.assert_close(out.loss.cpu(), ce, rtol=1e-5, atol=1e-6)
    assert abs(float(out.loss.detach()) - float(base(ids, attention_mask=mask, labels=ids).loss.detach())) > 1e-3


@pytest.mark.parametrize("dense_table", [True, False])
def test_training_leaves_the_prior_alone_and_decoding_carries_it(tok, dense_table, device, monkeypatch):
    """Both ways of adding it (a dense table's rows; past DENSE_TABLE_MAX the CSR's padded blocks) give the
    teacher-forced logits on every decoding path, the captured decode step on CUDA included."""
    import modeling_brillm.tables as tables

    if not dense_table:
        monkeypatch.setattr(tables, "DENSE_TABLE_MAX", 0)
    base = make_model(tok, node_size=6, seed=3, node_readout=True)
    model, prior = with_prior(base, corpus_ids(tok))
    model.to(device)
    assert (model.base_model.prior_table() is not None) == dense_table
    ids, mask = padded(tok)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits.cpu()[mask.bool()],
                               (base(ids, attention_mask=mask).logits + prior.table()[ids])[mask.bool()],
                               rtol=1e-5, atol=1e-5)
    assert not any(name.startswith("brillm.prior_") for name, _ in model.named_parameters())
    model.train()
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    assert float(model.base_model.weights.grad.abs().sum()) > 0
    model.eval()
    assert_decodes_like_forward(model, ids[:1, : int(mask[0].sum())].to(device))
    greedy = model.generate(ids[:1, :3].to(device), max_new_tokens=6, do_sample=False)  # captured on CUDA
    assert greedy.shape == (1, 9)
    model.decode_mode = "eager"
    assert torch.equal(model.generate(ids[:1, :3].to(device), max_new_tokens=6, do_sample=False), greedy)


def test_it_is_saved_loaded_and_grown(tok, tmp_path):
    model, prior = with_prior(make_model(tok, node_size=6, seed=4), corpus_ids(tok))
    model.save_pretrained(tmp_path)
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.count_prior and loaded.config.count_prior_bigrams == prior.num_bigrams
    ids = corpus_ids(tok)[0].unsqueeze(0)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert model.num_parameters() == model.config.num_parameters_formula()  # buffers, not parameters
    V = model.config.vocab_size
    model.resize_token_embeddings(V + 3)  # a new token was never seen: the smallest unigram, no successors
    assert model.base_model.prior_node.shape == (V + 3,)
    assert torch.equal(model.base_model.prior_node[V:], prior.node.min().expand(3))
    torch.testing.assert_close(model(ids).logits[..., :V], loaded(ids).logits, rtol=1e-6, atol=1e-6)


def test_a_corrupt_prior_in_a_checkpoint_is_a_clear_error(tok, tmp_path):
    from safetensors.torch import load_file, save_file

    model, _ = with_prior(make_model(tok, node_size=6, seed=5), corpus_ids(tok))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["brillm.prior_indices"] = weights["brillm.prior_indices"].flip(0).contiguous()  # no longer sorted
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="count prior does not fit its config.*prior_indices are not sorted"):
        BriLLMForCausalLM.from_pretrained(tmp_path)


def test_building_from_sequences_keeps_the_pruned_bigrams_in_the_prior(tok):
    seqs = corpus_ids(tok)
    V = len(tok)
    model = BriLLMForCausalLM.from_token_sequences(seqs, V, min_count=2, node_size=4, count_prior=True)
    keys, counts = count_bigrams(seqs, V)
    assert model.config.num_edges == int((counts >= 2).sum()) < keys.numel() == model.config.count_prior_bigrams
    torch.testing.assert_close(model.get_count_prior().table(), count_prior(keys, counts, V).table())


def test_sharded_trainer_adds_it_and_a_graph_without_it_is_refused(tok):
    from modeling_brillm.sharding import ShardedBriLLM

    model = with_prior(make_model(tok, node_size=6, seed=8), corpus_ids(tok))[0]  # the sharded trainer adds it
    ids = corpus_ids(tok)[0].unsqueeze(0)
    with torch.no_grad():
        want = float(model(ids, labels=ids).loss)
        assert float(ShardedBriLLM(model)(ids, labels=ids).loss) == pytest.approx(want, rel=1e-6)
    graph = build_sparse_graph(corpus_ids(tok), len(tok))
    config = BriLLMConfig(vocab_size=len(tok), num_edges=graph.num_edges, count_prior=True, count_prior_bigrams=3)
    with pytest.raises(ValueError, match="carries no count prior"):
        BriLLMForCausalLM.from_graph(graph, config=config)


@pytest.mark.parametrize("fields,message", [
    ({"count_prior": "yes"}, "count_prior must be True or False"),
    ({"count_prior": True, "loss_type": "sampled"}, "count_prior needs loss_type='exact'"),
    ({"count_prior": True, "graph": "dense"}, "count_prior needs a sparse graph"),
    ({"count_prior_bigrams": -1}, "count_prior_bigrams must be a non-negative integer"),
])
def test_bad_options_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        BriLLMConfig(vocab_size=10, **fields)


def test_a_prior_without_its_size_cannot_build_a_model():
    with pytest.raises(ValueError, match="count_prior needs count_prior_bigrams"):
        BriLLMForCausalLM(BriLLMConfig(vocab_size=10, num_edges=5, count_prior=True))
