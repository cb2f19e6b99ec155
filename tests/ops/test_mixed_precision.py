"""Autocast (`accelerate --mixed_precision bf16/fp16`) does not reach BriLLM's math: loss, logits, every gradient and
generated tokens are those of float32, bit for bit on the CPU (float32 rounding apart on CUDA, whose atomics add in any
order), on the torch path and on the Triton kernels (`exact_precision`).
Without it, the Triton path's shared-edge product ran in bfloat16 beside float32 energies (the tiny model's loss moved
by 2.8%) and the torch path cast every gathered edge row again at each product."""

import pytest
import torch
from _tiny import PAD, assert_same, corpus_ids, make_model, make_tokenizer

from modeling_brillm.backend import HAVE_TRITON, kernel_backend

BACKENDS = ["torch"] + (["triton"] if HAVE_TRITON else [])


def _batch(rows=6, length=20):
    """The first rows of the tiny corpus, padded (the third row is shorter than `length`) and cut to `length`
    columns: the interpreted Triton kernels cost time per row and column, and a few are enough to check."""
    tok = make_tokenizer()
    ids = torch.nn.utils.rnn.pad_sequence(corpus_ids(tok)[:rows], batch_first=True, padding_value=PAD)[:, :length]
    assert (ids == PAD).any(), "the batch should hold padding"
    return tok, ids, (ids != PAD).long()


def _run(model, ids, mask, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast(model.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.to_dense().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_changes_nothing(device, backend, dtype):
    tok, ids, mask = _batch()
    model = make_model(tok).to(device)
    model.sparse_gradients = True
    with kernel_backend(backend):
        loss, logits, grads = _run(model, ids, mask, None)
        loss_ac, logits_ac, grads_ac = _run(model, ids, mask, dtype)
    assert loss_ac.dtype == torch.float32 and logits_ac.dtype == torch.float32
    assert_same(loss_ac, loss)
    assert_same(logits_ac, logits)
    assert grads.keys() == grads_ac.keys() and len(grads) >= 4
    for name in grads:  # on CUDA, atomics sum some gradients in any order
        assert_same(grads_ac[name], grads[name], name)


def test_generation_under_autocast_gives_float32_tokens(device):
    tok, ids, mask = _batch()
    model = make_model(tok).to(device).eval()
    prompt = ids[:3, :4]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
    plain = model.generate(prompt, **kwargs)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        mixed = model.generate(prompt, **kwargs)
    assert torch.equal(mixed.sequences, plain.sequences)
    for a, b in zip(mixed.scores, plain.scores):
        assert torch.equal(a, b)
