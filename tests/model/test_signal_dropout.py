"""Signal dropout masks (`recurrence.dropout_mask`): a function of (seed, the row's index in the global batch,
position, dimension), so a row drops the same entries whether it is trained in the whole batch or in a process's
part of it; the statistics of `F.dropout`; the model's `dropout_rows` / `dropout_seed` keywords."""

import pytest
import torch

from modeling_brillm.recurrence import dropout_mask, mix64, scan_dropout_mask
from tests._tiny import corpus_ids, make_model, make_tokenizer


def test_a_rows_mask_is_the_same_in_the_whole_batch_and_in_a_split_part():
    rows, start = torch.arange(8), torch.tensor([0, 0, 3, 0, 5, 0, 0, 2])
    whole = scan_dropout_mask(0.3, 11, rows, start, (8, 6), 16, "cpu")
    assert whole.shape == (8, 7, 16)
    part = scan_dropout_mask(0.3, 11, rows[5:], start[5:], (3, 6), 16, "cpu")  # another process's 3 rows
    assert torch.equal(part, whole[5:])
    longer = scan_dropout_mask(0.3, 11, rows[:2], start[:2], (2, 9), 16, "cpu")  # padded to other lengths
    assert torch.equal(longer[:, :7], whole[:2])
    # a row keyed by its global index, not its place in the batch: row 5 first in a batch of its own
    alone = scan_dropout_mask(0.3, 11, torch.tensor([5]), start[5:6], (1, 6), 16, "cpu")
    assert torch.equal(alone, whole[5:6])
    # the same row at another position start, another seed, another row: other masks
    assert not torch.equal(whole[0], whole[1])
    assert not torch.equal(scan_dropout_mask(0.3, 12, rows, start, (8, 6), 16, "cpu"), whole)
    shifted = scan_dropout_mask(0.3, 11, rows[:1], start[:1] + 1, (1, 6), 16, "cpu")
    assert torch.equal(shifted[0, :-1], whole[0, 1:])  # the key is the position, not the column


def test_the_mask_keeps_with_probability_one_minus_p_scaled_as_f_dropout():
    rows, positions = torch.arange(64), torch.arange(65).expand(64, 65)
    for p in (0.1, 0.3, 0.4):
        mask = dropout_mask(p, mix64(7, 3), rows, positions, 32)
        assert mask.unique().tolist() == [0.0, pytest.approx(1 / (1 - p))]
        dropped, n = float((mask == 0).float().mean()), mask.numel()
        assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5, (p, dropped)
        assert float(mask.mean()) == pytest.approx(1.0, abs=0.02)  # E[mask] = 1, as F.dropout's
    zero = dropout_mask(0.5, 1, rows, positions, 32) == 0
    for dim in range(3):  # neighbours along rows, positions and dimensions agree half the time: no pattern
        a, b = zero.narrow(dim, 1, zero.shape[dim] - 1), zero.narrow(dim, 0, zero.shape[dim] - 1)
        assert float((a == b).float().mean()) == pytest.approx(0.5, abs=0.01), dim
    with pytest.raises(ValueError, match="p must be in"):
        dropout_mask(1.0, 1, rows, positions, 32)


def test_seeds_and_masks_are_fixed_functions():
    """Pinned values: a checkpoint resumes on the masks it was trained with only while these never change."""
    assert mix64(0, 0) == mix64(0, 0) != mix64(0, 1) != mix64(1, 0)
    assert -(1 << 63) <= mix64(-5, 1 << 70) < 1 << 63  # any integers, an int64 out
    assert mix64(1234, 10) == -1712022283449172562
    mask = dropout_mask(0.5, 77, torch.tensor([3, 1000]), torch.tensor([[0, 1, 2], [5, 6, 7]]), 4)
    assert (mask > 0).int().tolist() == [[[0, 0, 0, 0], [1, 0, 1, 0], [1, 0, 1, 0]],
                                         [[0, 0, 1, 0], [0, 1, 1, 0], [1, 0, 1, 0]]]


def _batch(tokenizer, n: int = 8):
    seqs = corpus_ids(tokenizer)[:n]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask


def _loss_and_grads(model, ids, mask, **kwargs):
    """(sum of the token losses, gradients of that sum) of one forward in train mode."""
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=ids, return_logits=False, **kwargs)
    scored = int((mask[:, 1:] * mask[:, :-1]).sum())
    total = out.loss * scored
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def dropped():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, signal_dropout=0.3)
    model.train()
    return model, *_batch(tokenizer)


def test_a_batch_split_in_two_with_global_rows_drops_what_the_whole_batch_drops(dropped):
    model, ids, mask = dropped
    whole, grads = _loss_and_grads(model, ids, mask, dropout_seed=5)
    halves, summed = 0.0, {}
    for part in (torch.arange(0, 3), torch.arange(3, 8)):  # uneven, as two processes may hold
        loss, g = _loss_and_grads(model, ids[part], mask[part], dropout_rows=part, dropout_seed=5)
        halves += loss
        for name, grad in g.items():
            summed[name] = summed[name] + grad if name in summed else grad
    assert halves == pytest.approx(whole, rel=1e-6)
    assert summed.keys() == grads.keys()
    for name in grads:  # float32 sums in another order: differences ~1e-6 of the gradient's scale, not of each entry
        scale = float(grads[name].abs().max())
        torch.testing.assert_close(summed[name], grads[name], rtol=1e-5, atol=2e-6 * scale, msg=name)
    # the local rows 0..2 of the second part are not the whole batch's rows 0..2: without the global rows the
    # second part would drop other entries
    local, _ = _loss_and_grads(model, ids[3:], mask[3:], dropout_seed=5)
    assert local != pytest.approx(halves - _loss_and_grads(model, ids[:3], mask[:3], dropout_seed=5)[0], rel=1e-6)


def test_seeds_and_the_plain_call(dropped):
    model, ids, mask = dropped
    first = _loss_and_grads(model, ids, mask, dropout_seed=1)[0]
    assert _loss_and_grads(model, ids, mask, dropout_seed=1)[0] == first  # a seed is a mask
    assert _loss_and_grads(model, ids, mask, dropout_seed=2)[0] != first
    # a plain call draws its seed from torch's generator: fresh masks each call, reproducible under manual_seed
    torch.manual_seed(0)
    a, b = _loss_and_grads(model, ids, mask)[0], _loss_and_grads(model, ids, mask)[0]
    torch.manual_seed(0)
    assert a != b and _loss_and_grads(model, ids, mask)[0] == a
    model.eval()  # no dropout outside training: the keywords change nothing
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, labels=ids).loss
        assert torch.equal(model(ids, attention_mask=mask, labels=ids, dropout_seed=3,
                                 dropout_rows=torch.arange(8) + 4).loss, ref)
    model.train()
    with pytest.raises(ValueError, match=r"dropout_rows must be integer row indices of shape \(batch,\) = \(8,\)"):
        model(ids, attention_mask=mask, labels=ids, dropout_rows=torch.arange(4))


def test_gradient_checkpointing_recomputes_the_same_mask(dropped):
    model, ids, mask = dropped
    plain = _loss_and_grads(model, ids, mask, dropout_seed=9)
    torch.manual_seed(1)
    drawn = _loss_and_grads(model, ids, mask)
    model.gradient_checkpointing_enable()
    try:
        seeded = _loss_and_grads(model, ids, mask, dropout_seed=9)
        torch.manual_seed(1)  # the seed is drawn once, before the checkpointed scan: its recompute keeps it
        recomputed = _loss_and_grads(model, ids, mask)
    finally:
        model.gradient_checkpointing_disable()
    for (loss, grads), (ref_loss, ref_grads) in ((seeded, plain), (recomputed, drawn)):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
