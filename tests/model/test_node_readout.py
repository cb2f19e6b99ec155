"""The default recipe's two model options: `node_readout` (every node also reads the signal, logit += <x, r_v>) and
`position_recency` (position weights that start at 1 + λ·k). Off, they are the release's model; on, the logits, the
loss, incremental decoding and a saved folder all carry them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
from tests._tiny import PAD, assert_decodes_like_forward, corpus_ids, make_model, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def with_options(base, dense=False, readout=None, **fields):
    """`base`'s weights in a model with the given config fields; `readout` fills node_readout."""
    model = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), **fields}))
    model.load_state_dict(base.state_dict(), strict=False)
    if readout is not None:
        with torch.no_grad():
            model.base_model.node_readout.copy_(readout)
    return model.eval()


def padded(tok):
    seqs = corpus_ids(tok)
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    return ids, mask


@pytest.mark.parametrize("dense", [False, True])
def test_readout_adds_the_nodes_reading_of_the_signal(tok, dense):
    """Zero readout: the release's logits exactly; a random one: logits + x·Rᵀ at every real position (x the
    signal the model returns as its hidden state), and the loss is the cross-entropy of those logits."""
    base = make_model(tok, dense=dense, node_size=6, seed=2)
    ids, mask = padded(tok)
    V, d = base.config.vocab_size, base.config.node_size
    ref = base(ids, attention_mask=mask, output_hidden_states=True)
    fresh = with_options(base, node_readout=True)
    assert torch.equal(fresh.base_model.node_readout, torch.zeros(V, d))
    torch.testing.assert_close(fresh(ids, attention_mask=mask).logits, ref.logits, rtol=0, atol=0)

    R = torch.randn(V, d, generator=torch.Generator().manual_seed(5))
    model = with_options(base, node_readout=True, readout=R)
    out = model(ids, attention_mask=mask, labels=ids)
    real = mask.bool()
    expected = ref.logits + ref.hidden_states[0] @ R.t()
    torch.testing.assert_close(out.logits[real], expected[real], rtol=1e-5, atol=1e-5)
    scored = real[:, 1:]
    ce = F.cross_entropy(out.logits[:, :-1][scored], ids[:, 1:][scored])
    torch.testing.assert_close(out.loss, ce, rtol=1e-5, atol=1e-6)
    assert abs(float(out.loss.detach()) - float(base(ids, attention_mask=mask, labels=ids).loss.detach())) > 1e-3


def test_readout_trains_and_decodes_like_the_teacher_forced_forward(tok):
    """The readout gets a gradient from every scored position, and the one-token paths (the general one and the
    sync-free step) give the teacher-forced logits."""
    base = make_model(tok, node_size=6, seed=3)
    V, d = base.config.vocab_size, base.config.node_size
    model = with_options(base, node_readout=True, readout=torch.randn(V, d, generator=torch.Generator().manual_seed(6)))
    ids, mask = padded(tok)
    model.train()
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    grad = model.base_model.node_readout.grad
    assert grad is not None and float(grad.abs().sum()) > 0
    model.eval()

    assert_decodes_like_forward(model, ids[:1, : int(mask[0].sum())])


def test_readout_and_recency_are_saved_and_loaded(tok, tmp_path):
    base = make_model(tok, node_size=6, seed=4)
    V, d = base.config.vocab_size, base.config.node_size
    model = with_options(base, node_readout=True, position_recency=0.3,
                         readout=torch.randn(V, d, generator=torch.Generator().manual_seed(7)))
    model.save_pretrained(tmp_path)
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.node_readout and loaded.config.position_recency == 0.3
    assert torch.equal(loaded.base_model.node_readout, model.base_model.node_readout)
    # the loaded position weights are the trained ones, not position_recency's start
    assert torch.equal(loaded.base_model.positions, model.base_model.positions)
    ids = corpus_ids(tok)[0].unsqueeze(0)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert model.num_parameters() == model.config.num_parameters_formula()  # the formula counts the readout


def test_position_recency_sets_where_the_weights_start(tok):
    base = make_model(tok, node_size=6, seed=1)
    M = base.config.max_position_embeddings
    assert torch.equal(BriLLMForCausalLM(base.config).base_model.positions.view(-1), torch.ones(M))
    fresh = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), "position_recency": 0.25}))
    torch.testing.assert_close(fresh.base_model.positions.view(-1), 1 + 0.25 * torch.arange(M, dtype=torch.float32))


@pytest.mark.parametrize("fields,message", [
    ({"node_readout": True, "loss_type": "sampled"}, "node_readout needs loss_type='exact'"),
    ({"node_readout": "yes"}, "node_readout must be True or False"),
    ({"position_recency": -0.1}, r"position_recency must be a number in \[0, 1\]"),
    ({"position_recency": True}, r"position_recency must be a number in \[0, 1\]"),
])
def test_bad_options_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        BriLLMConfig(vocab_size=10, **fields)
