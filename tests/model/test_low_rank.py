"""Low-rank edges (`config.edge_rank`, low_rank.py): W[u→v] = edge_base + A[u→v]·B[u→v]ᵀ. Their size, training,
saving and loading as remote code; tests/model/test_definition.py holds them to the definition on both backends."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
from tests.integration.test_remote_code import BLOCK_PACKAGE


def sequences(V=20, n=16, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length,), generator=g) for _ in range(n)]


def build(rank, d=8, **config):
    torch.manual_seed(0)
    return BriLLMForCausalLM.from_token_sequences(sequences(), vocab_size=20, node_size=d, edge_rank=rank, **config)


def test_its_size_is_the_formula_and_a_fraction_of_full_edges():
    full, low = build(0), build(2)
    assert {"edge_a", "edge_b"} <= {n.split(".")[-1] for n, _ in low.named_parameters()}
    assert not hasattr(low.base_model, "weights") and low.base_model.edge_row_parameters == ("edge_a", "edge_b",
                                                                                             "biases")
    for model in (full, low):
        assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters_formula()
    P, d = full.config.num_edge_rows, 8
    assert full.base_model.weights.numel() == P * d * d and low.base_model.edge_a.numel() == P * d * 2
    # A·Bᵀ starts with a full edge's spread of entries (uniform in ±initializer_range: variance r²/3)
    product = low.base_model.edge_parameters(torch.arange(P))[0].detach()
    assert float(product.var()) == pytest.approx(0.5 ** 2 / 3, rel=0.25)


def test_it_trains():
    model = build(2).train()
    ids = torch.stack(sequences(n=8, seed=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses = []
    for _ in range(20):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses


def test_sparse_gradients_touch_the_crossed_rows_and_equal_the_dense_ones():
    ids = torch.stack(sequences(n=4, seed=2))
    grads = {}
    for sparse in (False, True):
        model = build(2).train()
        model.sparse_gradients = sparse
        model(ids, labels=ids).loss.backward()
        grads[sparse] = {n: p.grad for n, p in model.base_model.named_parameters() if n in ("edge_a", "edge_b",
                                                                                             "biases")}
    for name, dense in grads[False].items():
        sparse = grads[True][name]
        assert sparse.is_sparse and not dense.is_sparse, name
        torch.testing.assert_close(sparse.to_dense(), dense, rtol=1e-5, atol=1e-6)
        touched = sparse.coalesce().indices()[0]
        assert 0 < touched.numel() < dense.shape[0] and (dense.flatten(1).abs().sum(1) > 0).sum() <= touched.numel()


def test_a_bad_rank_is_a_clear_error():
    with pytest.raises(ValueError, match=r"edge_rank must be an integer in \[0, node_size=8\], got 9"):
        BriLLMConfig(vocab_size=20, node_size=8, edge_rank=9)


def test_it_saves_and_loads_as_remote_code(tmp_path):
    """A saved low-rank folder loads, scores and generates in a process that cannot import the package."""
    model = build(2).eval()
    model.save_pretrained(tmp_path / "saved")
    ids = torch.stack(sequences(n=2, seed=2))[:, :5]
    with torch.no_grad():
        logits = model(ids).logits
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()
    code = BLOCK_PACKAGE + textwrap.dedent(f"""
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "saved")!r}, trust_remote_code=True)
        ids = torch.tensor({ids.tolist()})
        with torch.no_grad():
            logits = model(ids).logits
        print("RESULT " + json.dumps({{"logits": logits.tolist(), "module": type(model).__module__,
            "generated": model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()}}))
    """)
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["module"].startswith("transformers_modules") and result["generated"] == expected
    torch.testing.assert_close(torch.tensor(result["logits"]), logits, rtol=1e-5, atol=1e-5)
