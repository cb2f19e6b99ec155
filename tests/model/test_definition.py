"""Every backend against the definition (`modeling_brillm/naive.py`): the grouped torch path and the Triton kernels
(compiled on a GPU, in Triton's interpreter elsewhere) give its logits, loss, gradients and decoding, for both graph
kinds and with every extension on."""

import pytest
import torch

from modeling_brillm import BriLLMForCausalLM, naive
from modeling_brillm.backend import HAVE_TRITON, kernel_backend
from modeling_brillm.recurrence import dropout_mask

BACKENDS = ["torch"] + (["triton"] if HAVE_TRITON else [])
EXTENSIONS = dict(non_edge_bias=True, node_readout=True, edge_backoff=True, node_embedding=True, count_prior=True,
                  start_signal="learned", num_start_signals=2, position_recency=0.2)
TOL = dict(rtol=1e-5, atol=1e-5)


def sequences(V, n=8, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length,), generator=g) for _ in range(n)]


def build(dense=False, extensions=False, V=13, d=6, seed=0, **config):
    """A model whose every parameter is random (the extensions' too, which start at zero), so each term counts."""
    torch.manual_seed(seed)
    options = dict(EXTENSIONS) if extensions else {}
    if dense:
        options.pop("non_edge_bias", None), options.pop("count_prior", None)  # sparse-graph extensions
    model = BriLLMForCausalLM.from_token_sequences(sequences(V, seed=seed), vocab_size=V, node_size=d, dense=dense,
                                                   max_position_embeddings=16, **options, **config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("positions"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif not name.endswith(("weights", "biases", "node_bias", "edge_a", "edge_b")):  # random already
                p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=[(False, False, 0), (False, True, 0), (True, True, 0), (False, True, 2)],
                ids=["sparse", "sparse-extensions", "dense-extensions", "low-rank-extensions"])
def model(request):
    dense, extensions, rank = request.param
    return build(dense=dense, extensions=extensions, edge_rank=rank)


def batch(V, seed=1):
    """Two rows of different lengths (the second left-padded) and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_equal_the_definition(model, backend):
    ids, mask = batch(model.config.vocab_size)
    signal_ids = torch.tensor([0, 1]) if model.config.start_signal == "learned" else None
    with kernel_backend(backend), torch.no_grad():
        got = model(ids, attention_mask=mask, signal_ids=signal_ids).logits
    for row in range(2):
        real = mask[row].bool()
        expected = naive.forward(model, ids[row][real].tolist(), 0 if signal_ids is None else int(signal_ids[row]))
        torch.testing.assert_close(got[row][real], expected, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_and_gradients_equal_the_definition(model, backend):
    ids, _ = batch(model.config.vocab_size)
    model.zero_grad()
    with kernel_backend(backend):
        model(ids, labels=ids).loss.backward()
    got = {name: p.grad.to_dense().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    expected_loss = torch.stack([naive.loss(model, row.tolist()) for row in ids]).mean()
    expected_loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_signal_dropout_equals_the_definition_with_its_mask(backend):
    model = build(extensions=True, signal_dropout=0.3).train()
    ids, _ = batch(model.config.vocab_size)
    seed, rows = 1234, torch.arange(2)
    with kernel_backend(backend), torch.no_grad():
        got = model(ids, dropout_seed=seed, dropout_rows=rows).logits
    # the mask of the signal leaving token t is hashed at position t + 1 (position 0: the start signal, never dropped)
    keep = dropout_mask(0.3, seed, rows, torch.arange(1, ids.shape[1] + 1).expand(2, -1), model.config.node_size)
    for row in range(2):
        torch.testing.assert_close(got[row], naive.forward(model, ids[row].tolist(), keep=keep[row]), **TOL)


@pytest.mark.parametrize("mode", ["off", "eager", "auto"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_equals_the_definition(model, backend, mode):
    """The general path ("off"), the fixed-shape step ("eager", "auto") and generate() follow `naive.decode_step`."""
    prompt = [3, 5, 1]
    with kernel_backend(backend), torch.no_grad():
        model.decode_mode = mode
        try:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        finally:
            model.decode_mode = "auto"
    m = model.base_model
    signal = naive.start(m, prompt[0])
    for v in prompt[1:]:
        signal = naive.step(m, signal, v)
    logits = naive.logits(m, signal)
    for t, token in enumerate(out.sequences[0, len(prompt):].tolist()):
        torch.testing.assert_close(out.logits[t][0], logits, **TOL)
        assert token == int(logits.argmax())
        logits, signal = naive.decode_step(model, signal, token)


def test_the_extended_range_follows_the_definition():
    """position_overflow="extend": past the trained positions the last position weight and the PE formula."""
    model = build(extensions=True, position_overflow="extend")
    ids = torch.tensor([sequences(13, n=1, length=21, seed=4)[0].tolist()])
    with torch.no_grad():
        got = model(ids).logits[0]
    torch.testing.assert_close(got, naive.forward(model, ids[0].tolist()), **TOL)
