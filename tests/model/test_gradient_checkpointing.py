"""Gradient checkpointing: `model.gradient_checkpointing_enable()` (what `TrainingArguments(gradient_checkpointing=
True)` calls) recomputes the recurrence in the backward instead of keeping its signals, with the same loss and
gradients."""

import pytest
import torch
from _tiny import corpus_ids, make_model, make_tokenizer

import modeling_brillm.modeling_brillm as modeling


def _grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    loss = model(ids, attention_mask=mask, labels=ids, return_logits=False).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
    return loss.detach(), grads


@pytest.mark.parametrize("sparse", [False, True])
def test_checkpointed_training_step_equals_the_plain_one(sparse, monkeypatch):
    tok = make_tokenizer()
    model = make_model(tok, node_size=6, seed=1).train()
    model.sparse_gradients = sparse
    seqs = corpus_ids(tok)[:4]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    plain_loss, plain = _grads(model, ids, mask)

    calls = []
    scan = modeling.signal_scan
    monkeypatch.setattr(modeling, "signal_scan", lambda *a: calls.append(torch.is_grad_enabled()) or scan(*a))
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and model.base_model.gradient_checkpointing
    loss, grads = _grads(model, ids, mask)
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    assert grads.keys() == plain.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)

    model.gradient_checkpointing_disable()
    calls.clear()
    _grads(model, ids, mask)
    assert len(calls) == 1


def test_checkpointing_is_off_in_eval_and_without_grad():
    tok = make_tokenizer()
    model = make_model(tok, node_size=6, seed=1)
    model.gradient_checkpointing_enable()
    ids = corpus_ids(tok)[0][None]
    model.eval()
    reference = model(ids, labels=ids).loss
    model.train()
    with torch.no_grad():
        assert torch.equal(model(ids, labels=ids).loss, reference)
