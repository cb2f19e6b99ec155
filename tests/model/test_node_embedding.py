"""`node_embedding`: every node v adds its own vector e[v] to the edge output it passes on, c_i → c_i + e[u_i], so
the mix carries the recent nodes themselves. Zero, it is the release's model; any value, the signal leaving the
first edge is exactly the edge's output plus the entered node's vector, the one-token decoding paths follow the
teacher-forced forward, the gradient reaches the vectors, and a saved folder, a grown graph and the sharded trainer
keep or refuse it."""

from __future__ import annotations

import pytest
import torch

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
from tests._tiny import PAD, assert_decodes_like_forward, corpus_ids, make_model, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def embedded(base, seed: int = 7, **fields):
    """`base` with node_embedding on and random vectors (0.3·N(0, 1))."""
    model = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), **fields, "node_embedding": True}))
    model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        table = model.base_model.node_embedding
        table.copy_(0.3 * torch.randn(table.shape, generator=torch.Generator().manual_seed(seed)))
    return model.eval()


def test_zero_vectors_are_the_release(tok):
    base = make_model(tok, node_size=6, seed=2)
    seqs = corpus_ids(tok)
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    mask = (ids != PAD).long()
    fresh = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), "node_embedding": True}))
    fresh.load_state_dict(base.state_dict(), strict=False)
    assert torch.equal(fresh.base_model.node_embedding, torch.zeros(len(tok), 6))
    torch.testing.assert_close(fresh.eval()(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits,
                               rtol=0, atol=0)


def test_the_signal_after_one_edge_is_its_output_plus_the_nodes_vector(tok):
    """Two tokens: the mix holds one edge output, so x_1 = c_1 + e[u_1] exactly, with c_1 the release's."""
    base = make_model(tok, node_size=6, seed=3)
    model = embedded(base)
    ids = corpus_ids(tok)[0][:2].unsqueeze(0)
    plain = base.base_model(ids).last_hidden_state
    signal = model.base_model(ids).last_hidden_state
    torch.testing.assert_close(signal[:, 0], plain[:, 0], rtol=0, atol=0)  # the start signal has no edge
    torch.testing.assert_close(signal[:, 1], plain[:, 1] + model.base_model.node_embedding[ids[0, 1]],
                               rtol=1e-6, atol=1e-6)
    longer = corpus_ids(tok)[0].unsqueeze(0)
    assert not torch.allclose(model(longer).logits, base(longer).logits)


def test_embedding_decodes_like_the_teacher_forced_forward(tok):
    """The general one-token path and the sync-free step add the vectors too; generate() follows them."""
    model = embedded(make_model(tok, node_size=6, seed=4), node_readout=True, non_edge_bias=True, edge_backoff=True)
    row = corpus_ids(tok)[3].unsqueeze(0)
    assert_decodes_like_forward(model, row)
    out = model.generate(row[:, :4], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 10)


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_the_gradient_reaches_the_vectors_as_finite_differences_say(tok, sparse_grad):
    model = embedded(make_model(tok, node_size=6, seed=5), node_readout=True, non_edge_bias=True)
    model.train()
    model.sparse_gradients = sparse_grad
    ids = corpus_ids(tok)[1].unsqueeze(0)
    model(ids, labels=ids).loss.backward()
    table = model.base_model.node_embedding
    grad = table.grad
    v, j = int(ids[0, 2]), 1
    assert float(grad[ids[0, 1:-1]].abs().sum()) > 0
    assert float(grad[ids[0, 0]].abs().sum()) == 0 or bool((ids[0, 1:] == ids[0, 0]).any())  # u_0 enters no edge
    with torch.no_grad():  # central differences: the mix runs in float32, so a step of 1e-2 (error O(eps²))
        eps = 1e-2
        table[v, j] += eps
        up = model(ids, labels=ids).loss
        table[v, j] -= 2 * eps
        down = model(ids, labels=ids).loss
        table[v, j] += eps
    torch.testing.assert_close(grad[v, j], (up - down) / (2 * eps), rtol=2e-2, atol=1e-5)


def test_vectors_are_saved_loaded_counted_and_grown(tok, tmp_path):
    model = embedded(make_model(tok, node_size=6, seed=6))
    model.save_pretrained(tmp_path)
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.node_embedding
    assert torch.equal(loaded.base_model.node_embedding, model.base_model.node_embedding)
    ids = corpus_ids(tok)[0].unsqueeze(0)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert model.num_parameters() == model.config.num_parameters_formula()
    V = model.config.vocab_size
    model.resize_token_embeddings(V + 3)
    assert model.base_model.node_embedding.shape == (V + 3, 6)
    torch.testing.assert_close(model(ids).logits[..., :V], loaded(ids).logits, rtol=1e-6, atol=1e-6)


def test_the_sharded_trainer_scores_it_as_the_model(tok):
    from modeling_brillm.sharding import ShardedBriLLM

    model = embedded(make_model(tok, node_size=6, seed=8))
    ids = corpus_ids(tok)[0].unsqueeze(0)
    with torch.no_grad():
        want = float(model(ids, labels=ids).loss)
        assert float(ShardedBriLLM(model)(ids, labels=ids).loss) == pytest.approx(want, rel=1e-6)


def test_bad_value_is_a_clear_error():
    with pytest.raises(ValueError, match="node_embedding must be True or False"):
        BriLLMConfig(vocab_size=10, node_embedding="yes")
