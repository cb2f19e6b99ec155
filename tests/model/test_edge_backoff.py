"""`edge_backoff`: every edge u→v computes x·(edge_base + W[u→v]) + b + PE. Zero, it is the release's model; any
value, it is exactly the model whose every edge-table row has edge_base folded in, in the logits, the gradients, the
one-token decoding paths, a saved folder and a grown graph."""

from __future__ import annotations

import pytest
import torch

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
from tests._tiny import PAD, assert_decodes_like_forward, corpus_ids, make_model, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def padded(tok):
    seqs = corpus_ids(tok)
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    return ids, mask


def backoff_pair(base, seed: int = 5, **fields):
    """(a back-off model with a random edge_base B on `base`'s weights, the plain model whose rows are W + B)."""
    d = base.config.node_size
    B = 0.3 * torch.randn(d, d, generator=torch.Generator().manual_seed(seed))
    backoff = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), **fields, "edge_backoff": True}))
    backoff.load_state_dict(base.state_dict(), strict=False)
    folded = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), **fields}))
    folded.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        backoff.base_model.edge_base.copy_(B)
        folded.base_model.weights += B
    return backoff.eval(), folded.eval()


def test_a_zero_edge_base_is_the_release(tok):
    base = make_model(tok, node_size=6, seed=2)
    ids, mask = padded(tok)
    fresh = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), "edge_backoff": True}))
    fresh.load_state_dict(base.state_dict(), strict=False)
    assert torch.equal(fresh.base_model.edge_base, torch.zeros(6, 6))
    torch.testing.assert_close(fresh.eval()(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits,
                               rtol=0, atol=0)


@pytest.mark.parametrize("dense,sparse_grad,readout", [(False, False, False), (False, True, True), (True, False, True)])
def test_backoff_is_the_folded_model_in_logits_and_gradients(tok, dense, sparse_grad, readout):
    """Logits and loss equal the folded model's; edge_base's gradient is the sum of the folded rows' gradients (it is
    in every edge), and each row's own gradient is the folded row's."""
    base = make_model(tok, dense=dense, node_size=6, seed=3)
    backoff, folded = backoff_pair(base, node_readout=readout, non_edge_bias=not dense)
    ids, mask = padded(tok)
    grads = []
    for model in (backoff, folded):
        model.train()
        model.sparse_gradients = sparse_grad
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grad = model.base_model.weights.grad
        grads.append((out, grad.to_dense() if grad.is_sparse else grad))
    (out_b, grad_b), (out_f, grad_f) = grads
    real = mask.bool()
    torch.testing.assert_close(out_b.logits[real], out_f.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_b.loss, out_f.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_b, grad_f, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(backoff.base_model.edge_base.grad, grad_f.sum(0), rtol=1e-4, atol=1e-5)
    assert float(backoff.base_model.edge_base.grad.abs().sum()) > 0


def test_backoff_decodes_like_the_teacher_forced_forward(tok):
    """The general one-token path and the sync-free step carry the shared matrix too; so does generate()."""
    base = make_model(tok, node_size=6, seed=4)
    model, folded = backoff_pair(base, node_readout=True, non_edge_bias=True)
    ids, mask = padded(tok)
    assert_decodes_like_forward(model, ids[:1, : int(mask[0].sum())])
    prompt = ids[:2, :4]
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False),
                       folded.generate(prompt, max_new_tokens=6, do_sample=False))


def test_backoff_is_saved_loaded_and_counted(tok, tmp_path):
    model, _ = backoff_pair(make_model(tok, node_size=6, seed=5))
    model.save_pretrained(tmp_path)
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.edge_backoff
    assert torch.equal(loaded.base_model.edge_base, model.base_model.edge_base)
    ids = corpus_ids(tok)[0].unsqueeze(0)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert model.num_parameters() == model.config.num_parameters_formula()


def test_a_new_edge_keeps_the_prediction_it_had(tok):
    """add_edges copies the shared edge into the new row, and the shared matrix is added to both: no logit moves."""
    model, _ = backoff_pair(make_model(tok, node_size=6, seed=6), non_edge_bias=True)
    ids = corpus_ids(tok)[1].unsqueeze(0)
    before = model(ids).logits
    V = model.config.vocab_size
    rows_of = model.edge_rows
    new = [(u, v) for u in range(4, 8) for v in range(4, V) if int(rows_of(torch.tensor([u]), torch.tensor([v]))) == 0]
    new = new[:5]
    assert len(new) == 5
    rows = model.add_edges(new)
    assert torch.equal(model.base_model.weights[rows], model.base_model.weights[0].expand(5, -1, -1))
    torch.testing.assert_close(model(ids).logits, before, rtol=1e-6, atol=1e-6)


def test_bad_value_is_a_clear_error():
    with pytest.raises(ValueError, match="edge_backoff must be True or False"):
        BriLLMConfig(vocab_size=10, edge_backoff="yes")
