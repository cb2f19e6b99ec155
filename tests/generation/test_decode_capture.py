"""The sync-free decode step (`BriLLMModel.decode_step`, `decode_mode`) and its CUDA-graph capture.

On CPU: the eager sync-free step gives the logits and tokens of the general path (generate, energy_generate, beam
search, sampling, left padding, dense and sparse graphs), runs on `device="meta"` (so it holds no host read and no
data-dependent shape, which is what a CUDA graph needs), and checks the position range from a host-side bound. The
capture itself needs a GPU: its test is skipped here and runs on a CUDA machine.
"""

import pytest
import torch
from _tiny import make_model, make_tokenizer
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList

from modeling_brillm import decoding, generation
from modeling_brillm.modeling_brillm import BriLLMState
from modeling_brillm.state import CACHE, TENSORS


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer()
    t.padding_side = "left"
    return t


@pytest.fixture(scope="module")
def models(tok):
    return {False: make_model(tok, node_size=6, seed=3), True: make_model(tok, dense=True, node_size=6, seed=3)}


def _enc(tok):
    return tok(["the cat", "a dog saw", "my"], return_tensors="pt", padding=True)


def _run(model, mode, fn):
    model.decode_mode = mode
    try:
        with torch.no_grad():  # generate() runs without gradients; the one-token paths need that too
            return fn()
    finally:
        model.decode_mode = "auto"


@pytest.mark.parametrize("dense", [False, True])
def test_eager_sync_free_step_equals_the_general_path(models, tok, dense):
    model = models[dense]
    enc = _enc(tok)

    def decode():
        g = model.generate(**enc, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        e = model.energy_generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=6)
        b = model.generate(**enc, max_new_tokens=4, num_beams=3, do_sample=False)
        torch.manual_seed(0)
        s = model.generate(**enc, max_new_tokens=5, do_sample=True, top_k=5)
        return g, e, b, s

    off = _run(model, "off", decode)
    eager = _run(model, "eager", decode)
    assert torch.equal(eager[0].sequences, off[0].sequences)
    torch.testing.assert_close(torch.stack(eager[0].logits), torch.stack(off[0].logits), rtol=1e-5, atol=1e-5)
    assert torch.equal(eager[1].sequences, off[1].sequences)
    torch.testing.assert_close(eager[1].energies, off[1].energies, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(eager[2], off[2])
    assert torch.equal(eager[3], off[3])
    # generate() returned the final state; the sync-free one tracks the longest row on the host
    state = eager[0][CACHE]
    assert isinstance(state, BriLLMState) and state.longest == int(state.length.max())


def test_direct_calls_check_their_inputs_and_positions(models, tok):
    model = models[False]
    enc = _enc(tok)
    out = model(**enc, use_cache=True)
    state = out.state
    step = torch.tensor([[5], [6], [7]])
    ref = _run(model, "off", lambda: model(step, cache=state.clone(), use_cache=True))
    got = _run(model, "eager", lambda: model(step, cache=state.clone(), use_cache=True))
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.state.signal, ref.state.signal)
    # a direct call (no generation_step) still validates its ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _run(model, "eager", lambda: model(step + 1000, cache=state.clone()))
    # a padded new column goes to the general path, with the same result as there
    mask = torch.cat([enc["attention_mask"], torch.tensor([[1], [0], [1]])], 1)
    ref = _run(model, "off", lambda: model(step, attention_mask=mask, cache=state.clone()))
    got = _run(model, "eager", lambda: model(step, attention_mask=mask, cache=state.clone()))
    torch.testing.assert_close(got.logits, ref.logits)
    # the position limit comes from the host-side bound, with the general path's message
    model.config.max_position_embeddings = 6
    try:
        out = model(torch.tensor([[2, 5, 6, 7, 8]]), use_cache=True)
        nxt = _run(model, "eager", lambda: model(torch.tensor([[9]]), cache=out.state,
                                                 generation_step=True))
        assert nxt.state.longest == 6
        with pytest.raises(ValueError, match="exceeds max_position_embeddings=6"):
            _run(model, "eager", lambda: model(torch.tensor([[9]]), cache=nxt.state,
                                               generation_step=True))
    finally:
        model.config.max_position_embeddings = 64
    with pytest.raises(ValueError, match="decode_mode"):
        _run(model, "sometimes", lambda: model(step, cache=state.clone()))


def test_generation_step_clamps_a_finished_rows_pad_token(models, tok):
    """Only finished rows are fed ids the model did not pick (the pad token, possibly outside the vocabulary):
    the trusted step clamps them instead of reading the device to check, and the live rows are unaffected."""
    model = models[False]
    enc = _enc(tok)
    state = model(**enc, use_cache=True).state
    V = model.config.vocab_size
    good = torch.tensor([[5], [6], [7]])
    bad = torch.tensor([[5], [V + 3], [7]])
    ref = _run(model, "eager", lambda: model(good, cache=state.clone(), generation_step=True))
    got = _run(model, "eager", lambda: model(bad, cache=state.clone(), generation_step=True))
    torch.testing.assert_close(got.logits[[0, 2]], ref.logits[[0, 2]])


def test_energy_generate_reads_finished_rows_lazily_with_the_same_result(models, tok, monkeypatch):
    """On a GPU energy_generate asks "all finished?" every 8 steps and drops the extra steps at the end."""
    model = models[False]
    enc = _enc(tok)
    kwargs = dict(attention_mask=enc["attention_mask"], max_new_tokens=20, pad_token_id=0, repetition_penalty=1.3)
    free = model.energy_generate(enc["input_ids"], eos_token_id=[], **kwargs).tokens
    # the eos: the node every row reaches soonest, so that all rows finish early (at different steps)
    first = {t: max(row.tolist().index(t) if t in row.tolist() else 99 for row in free) for t in free.unique().tolist()}
    eos = min(first, key=first.get)
    kwargs["eos_token_id"] = eos
    ref = model.energy_generate(enc["input_ids"], **kwargs)
    monkeypatch.setattr(decoding, "finish_check_every", lambda device: 8)
    got = _run(model, "eager", lambda: model.energy_generate(enc["input_ids"], **kwargs))
    assert ref.num_steps < 20 and ref.num_steps % 8  # all rows ended, between two reads
    assert got.num_steps == ref.num_steps
    assert torch.equal(got.sequences, ref.sequences) and torch.equal(got.step_mask, ref.step_mask)
    torch.testing.assert_close(got.energies, ref.energies, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense", [False, True])
def test_the_step_runs_on_meta_tensors(models, tok, dense):
    """Every op of the step exists on `meta` with shapes known in advance: no .item(), .tolist(), nonzero() or
    data-dependent size, hence nothing that waits for the GPU (the tables it reads are built before, once)."""
    model = models[dense]
    B = 4
    max_degree = model.base_model.graph_view().max_degree
    keys = model.base_model.edge_keys()  # built once per graph from the device
    meta = make_model(tok, dense=dense, node_size=6, seed=3).to("meta").base_model
    if not dense:  # carry the key table over to the meta copy
        meta.edge_keys = lambda: keys.to("meta")
    d = model.config.node_size
    state = BriLLMState.of([torch.empty(B, d, device="meta"), torch.empty(B, d, device="meta"),
                            torch.empty(B, device="meta"), torch.empty(B, device="meta"),
                            torch.empty(B, dtype=torch.long, device="meta"),
                            torch.empty(B, dtype=torch.long, device="meta")], seen=3, longest=3)
    with torch.no_grad():
        logits, new_state = meta.decode_step(torch.empty(B, dtype=torch.long, device="meta"), state, max_degree)
    assert logits.shape == (B, model.config.vocab_size) and logits.device.type == "meta"
    assert [t.shape for t in new_state.tensors()] == [t.shape for t in state.tensors()]


def test_a_failed_capture_falls_back_to_the_eager_step(tok, monkeypatch, caplog):
    """Capture has never run on most users' GPU / driver / triton: where it fails, decoding goes on uncaptured with
    the same step (one warning), instead of stopping generate(). Simulated here: the capture raises."""
    from modeling_brillm.generation import DecodeGraphs

    model = make_model(tok, node_size=6, seed=3)

    def fail(self, *args):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(DecodeGraphs, "step", fail)
    enc = _enc(tok)
    with torch.no_grad():
        state = model(**enc, use_cache=True).state
        tokens = torch.tensor([5, 6, 7])
        with caplog.at_level("WARNING"):
            assert model._replay_decode_graph(tokens, state, model.base_model.step_tables()) is None
        assert model.decode_mode == "eager" and not model._decode_graphs.graphs
        assert "capturing the decode step into a CUDA graph failed (RuntimeError: CUDA error: operation not " \
               "permitted when stream is capturing)" in caplog.text and "more detail" not in caplog.text
        # the eager step it falls back to: the general path's logits
        eager = model(input_ids=tokens[:, None], cache=state, generation_step=True).logits
        model.decode_mode = "off"
        general = model(input_ids=tokens[:, None], cache=state).logits
    torch.testing.assert_close(eager, general, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dense", [False, True])
def test_captured_step_replays_the_eager_step(models, tok, dense):
    model = models[dense].cuda()
    enc = {k: v.cuda() for k, v in _enc(tok).items()}
    try:
        eager = _run(model, "eager", lambda: model.generate(**enc, max_new_tokens=10, do_sample=False,
                                                            return_dict_in_generate=True, output_logits=True))
        captured = model.generate(**enc, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                                  output_logits=True)
        assert len(model._decode_graphs.graphs) == 1
        assert torch.equal(captured.sequences, eager.sequences)
        torch.testing.assert_close(torch.stack(captured.logits), torch.stack(eager.logits))
        assert not captured[CACHE].graph_owned  # generate() hands out a copy
        e1 = model.energy_generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=10)
        e2 = _run(model, "eager", lambda: model.energy_generate(enc["input_ids"], attention_mask=enc["attention_mask"],
                                                                max_new_tokens=10))
        assert torch.equal(e1.sequences, e2.sequences)
        beams = model.generate(**enc, max_new_tokens=5, num_beams=2, do_sample=False)
        assert torch.equal(beams, _run(model, "eager", lambda: model.generate(**enc, max_new_tokens=5, num_beams=2,
                                                                               do_sample=False)))
    finally:
        model.cpu()
        model._decode_graphs = None


def test_large_padded_gathers_take_the_general_path(models, tok, monkeypatch):
    """Without Triton the sync-free step gathers rows × max-degree matrices; past `padded_decode_bytes` the one-token
    step takes the general path (same logits), so a dense graph at a large batch does not allocate gigabytes."""
    model = models[True]
    enc = _enc(tok)
    state = model(**enc, use_cache=True).state
    step = torch.tensor([[5], [6], [7]])
    ref = _run(model, "eager", lambda: model(step, cache=state.clone(), generation_step=True))

    def padded_step(*args):
        raise AssertionError("the padded step ran")

    monkeypatch.setattr(type(model.base_model), "decode_step", padded_step)
    monkeypatch.setattr(model, "padded_decode_bytes", 1024)
    out = _run(model, "eager", lambda: model(step, cache=state.clone(), generation_step=True))
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_non_edge_bias_sync_free_step_equals_the_general_path(tok):
    """A model with `non_edge_bias` decodes through the sync-free step too (shared + bias[v] for non-successors):
    the general path's logits and tokens, and the step's torch version still runs on `meta`."""
    from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
    from modeling_brillm.energy import successor_logits
    from modeling_brillm.tables import EdgeTable, GraphView

    base = make_model(tok, node_size=6, seed=3)
    model = BriLLMForCausalLM(BriLLMConfig(**{**base.config.to_dict(), "non_edge_bias": True}))
    model.base_model.load_state_dict(base.base_model.state_dict(), strict=False)
    with torch.no_grad():
        model.base_model.non_edge_bias.copy_(torch.randn(model.config.vocab_size,
                                                         generator=torch.Generator().manual_seed(4)) * 2)
    enc = _enc(tok)

    def decode():
        g = model.generate(**enc, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        e = model.energy_generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=6)
        return g, e

    off = _run(model, "off", decode)
    calls = []
    original = type(model.base_model).decode_step
    type(model.base_model).decode_step = lambda self, *a: calls.append(1) or original(self, *a)
    try:
        eager = _run(model, "eager", decode)
    finally:
        type(model.base_model).decode_step = original
    assert calls, "the sync-free step did not run"
    assert torch.equal(eager[0].sequences, off[0].sequences)
    torch.testing.assert_close(torch.stack(eager[0].logits), torch.stack(off[0].logits), rtol=1e-5, atol=1e-5)
    assert torch.equal(eager[1].sequences, off[1].sequences)
    # the bias is not a no-op: the first step's logits differ from the model without it
    plain = _run(base, "off", lambda: base.generate(**enc, max_new_tokens=1, do_sample=False, output_logits=True,
                                                    return_dict_in_generate=True))
    assert not torch.allclose(plain.logits[0], off[0].logits[0])
    B, d, V, P = 4, 6, model.config.vocab_size, model.base_model.weights.shape[0]
    edges = EdgeTable(torch.empty(P, d, d, device="meta"), torch.empty(P, 1, d, device="meta"),
                      non_edge_bias=torch.empty(V, device="meta"))
    graph = GraphView(torch.empty(V + 1, dtype=torch.long, device="meta"),
                      torch.empty(P - 1, dtype=torch.long, device="meta"), None, V)
    logits = successor_logits(torch.empty(B, d, device="meta"), torch.empty(B, d, device="meta"), edges,
                              torch.empty(B, dtype=torch.long, device="meta"), graph,
                              model.base_model.graph_view().max_degree)
    assert logits.shape == (B, V) and logits.device.type == "meta"


@pytest.mark.parametrize("dense", [False, True])
def test_one_row_on_the_cpu_takes_the_one_token_step(models, tok, dense, monkeypatch):
    """One row on the CPU ("auto") decodes through the one-token step, each row's successors read from the host:
    generate (greedy, sampling) and energy_generate give the general path's tokens, and its logits within float32
    rounding."""
    model = models[dense]
    enc = tok(["a dog saw"], return_tensors="pt")

    def decode():
        g = model.generate(**enc, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
        e = model.energy_generate(enc["input_ids"], max_new_tokens=8)
        torch.manual_seed(0)
        s = model.generate(**enc, max_new_tokens=8, do_sample=True, top_k=5, repetition_penalty=1.3)
        return g, e, s

    off = _run(model, "off", decode)
    widths = []
    original = type(model.base_model).decode_step
    monkeypatch.setattr(type(model.base_model), "decode_step",
                        lambda self, tokens, state, width=None, tables=None: widths.append(width)
                        or original(self, tokens, state, width, tables))
    auto = _run(model, "auto", decode)
    assert len(widths) >= 14 and set(widths) == {None}, "one-row decoding did not take the one-token step"
    assert torch.equal(auto[0].sequences, off[0].sequences)
    torch.testing.assert_close(torch.stack(auto[0].logits), torch.stack(off[0].logits), rtol=1e-5, atol=1e-5)
    assert torch.equal(auto[1].sequences, off[1].sequences)
    torch.testing.assert_close(auto[1].energies, off[1].energies, rtol=1e-5, atol=1e-5)
    assert torch.equal(auto[2], off[2])


@pytest.mark.parametrize("extensions, dtype", [
    ({}, torch.float32),
    (dict(node_embedding=True, edge_backoff=True, non_edge_bias=True, node_readout=True, count_prior=True),
     torch.float32),
    (dict(node_embedding=True, edge_backoff=True, non_edge_bias=True, node_readout=True), torch.bfloat16),
], ids=["released", "extensions", "bfloat16"])
def test_one_row_steps_give_the_teacher_forced_logits(tok, extensions, dtype):
    """A row of edges and non-edges through the one-token step, direct calls, gives the teacher-forced logits at
    every position (in a bfloat16 model, to bfloat16's rounding), and its state the general path's."""
    model = make_model(tok, node_size=6, seed=4, **extensions).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    graph_rows = model.base_model.edge_rows(torch.arange(20).repeat_interleave(20), torch.arange(20).repeat(20))
    assert bool((graph_rows == 0).any()) and bool((graph_rows > 0).any())
    row = torch.tensor([[3, 7, 7, 2, 9, 4, 4, 11, 5, 3, 8, 1, 6, 10, 2, 12, 3, 7]])
    pairs = model.base_model.edge_rows(row[0, :-1], row[0, 1:])
    assert bool((pairs == 0).any()) and bool((pairs > 0).any()), "the row crosses edges and non-edges"
    full = model(row).logits
    with torch.no_grad():
        state = model(row[:, :2], use_cache=True).state
        for t in range(2, row.shape[1]):
            out = model(row[:, t:t + 1], cache=state, use_cache=True)
            torch.testing.assert_close(out.logits[:, 0], full[:, t], rtol=tolerance, atol=tolerance)
            state = out.state
        reference = model(row, use_cache=True).state
        for name, got, want in zip(TENSORS, state.tensors(), reference.tensors()):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_the_host_step_checks_ids_positions_and_padding(models, tok):
    """A direct call still validates its id; the position limit gives the general path's message; a padding column
    is refused on both paths; with position_overflow="extend" the rows past the table match the general path."""
    model = models[False]
    state = model(torch.tensor([[2, 5, 6]]), use_cache=True).state
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _run(model, "auto", lambda: model(torch.tensor([[model.config.vocab_size]]), cache=state.clone()))
    padded = torch.tensor([[1, 1, 1, 0]])  # a padding column is no step: said in one line, on both paths
    for mode in ("off", "auto"):
        with pytest.raises(ValueError, match="every token of this call is padding"):
            _run(model, mode, lambda: model(torch.tensor([[7]]), attention_mask=padded, cache=state.clone()))
    config = model.config
    config.max_position_embeddings = 4
    try:
        nxt = _run(model, "auto", lambda: model(torch.tensor([[7]]), cache=state.clone())).state
        with pytest.raises(ValueError, match="exceeds max_position_embeddings=4"):
            _run(model, "auto", lambda: model(torch.tensor([[8]]), cache=nxt))
        config.position_overflow = "extend"
        model.base_model.reset_caches()
        ref_state, got_state = state.clone(), state.clone()
        for token in (7, 8, 9, 5):  # positions 3..6: across the end of the table (rows 0..4)
            step = torch.tensor([[token]])
            ref = _run(model, "off", lambda s=ref_state, t=step: model(t, cache=s))
            got = _run(model, "auto", lambda s=got_state, t=step: model(t, cache=s))
            torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
            ref_state, got_state = ref.state, got.state
    finally:
        config.max_position_embeddings, config.position_overflow = 64, "error"
        model.base_model.reset_caches()


class _Recorder:
    """A streamer that records what it is handed (transformers' BaseStreamer interface)."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


@pytest.mark.parametrize("kwargs", [
    dict(do_sample=False, eos_token_id=None, max_new_tokens=12),
    dict(do_sample=False, max_new_tokens=12, min_new_tokens=3),  # the model's eos stops it (or the length)
    dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=10, output_scores=True),
    dict(do_sample=False, max_length=9, no_repeat_ngram_size=2, output_scores=True, output_logits=True),
], ids=["greedy", "eos", "sample", "max_length"])
def test_one_row_generate_loop_matches_transformers_loop(models, tok, kwargs):
    """One row on the CPU runs generate()'s loop around the host step: sequences and the streamer's calls equal
    transformers' own loop on the general path, scores, logits and the returned state within float32 rounding."""
    model = models[False]
    enc = tok(["the cat"], return_tensors="pt")

    def decode():
        streamer = _Recorder()
        torch.manual_seed(1)
        out = model.generate(**enc, streamer=streamer, return_dict_in_generate=True, **kwargs)
        return out, streamer.calls

    (ref, ref_calls), (got, got_calls) = _run(model, "off", decode), _run(model, "auto", decode)
    assert torch.equal(got.sequences, ref.sequences) and got_calls == ref_calls
    for name in ("scores", "logits"):
        if getattr(ref, name) is not None:
            torch.testing.assert_close(torch.stack(getattr(got, name)), torch.stack(getattr(ref, name)), rtol=1e-5,
                                       atol=1e-5, msg=name)
    torch.testing.assert_close(got[CACHE].signal, ref[CACHE].signal, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[CACHE].length, ref[CACHE].length)


class _AtLength(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_the_one_row_loop_ends_at_eos_on_the_host(models, tok):
    """One row on the CPU compares its pick with the EOS ids on the host: it ends where transformers' loop ends, at
    any of several EOS ids, and a criterion of the caller's beside them still stops it."""
    model = models[False]
    enc = tok(["the cat"], return_tensors="pt")
    start = enc["input_ids"].shape[1]
    free = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, start:].tolist()
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # first picked at step i >= 3
    for kwargs in (dict(eos_token_id=eos), dict(eos_token_id=[model.config.vocab_size + 5, eos]),
                   dict(eos_token_id=eos, stopping_criteria=StoppingCriteriaList([_AtLength(start + 2)]))):
        def decode(kwargs=kwargs):
            return model.generate(**enc, max_new_tokens=12, do_sample=False, **kwargs)

        ref, got = _run(model, "off", decode), _run(model, "auto", decode)
        assert torch.equal(got, ref) and got.shape[1] < start + 12, kwargs
        assert got[0, -1].item() == eos or "stopping_criteria" in kwargs


def test_the_loop_leaves_what_it_does_not_do_to_transformers(models, tok, monkeypatch):
    """Hidden states and use_cache=False go through transformers' loop; a batch of rows and one row through ours."""
    model = models[False]
    entered = []
    original = generation.decode_loop
    monkeypatch.setattr(generation, "decode_loop", lambda *a: entered.append(True) or original(*a))
    transformers_loop = GenerationMixin._sample
    monkeypatch.setattr(GenerationMixin, "_sample",
                        lambda self, *a, **k: entered.append(False) or transformers_loop(self, *a, **k))
    one = tok(["the cat"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**one, max_new_tokens=3, do_sample=False, output_hidden_states=True,
                             return_dict_in_generate=True)
        model.generate(**_enc(tok), max_new_tokens=3, do_sample=False)
        uncached = model.generate(**one, max_new_tokens=3, do_sample=False, use_cache=False)
        cached = model.generate(**one, max_new_tokens=3, do_sample=False)
    assert entered == [False, True, False, True] and out.hidden_states is not None
    assert torch.equal(uncached, cached)


@pytest.mark.parametrize("max_new_tokens", [20, 5])
def test_the_sync_free_loop_reads_finished_rows_every_few_steps(models, tok, monkeypatch, max_new_tokens):
    """generate()'s own loop around the sync-free step (on a GPU: reads "has every row finished?" every 8 steps)
    drops the padding steps past the end and never steps past the length asked: transformers' result."""
    model = models[False]
    enc = _enc(tok)
    free = model.generate(**enc, max_new_tokens=20, do_sample=False, eos_token_id=None)[:, enc["input_ids"].shape[1]:]
    # an eos every row reaches, at different steps
    first = {t: max(row.tolist().index(t) if t in row.tolist() else 99 for row in free) for t in free.unique().tolist()}
    eos = min(first, key=first.get)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    ref = _run(model, "off", lambda: model.generate(**enc, **kwargs))
    steps = []
    monkeypatch.setattr(generation, "finish_check_every", lambda device: 8)
    original = type(model).generation_step
    monkeypatch.setattr(type(model), "generation_step", lambda self, *a: steps.append(1) or original(self, *a))
    got = _run(model, "eager", lambda: model.generate(**enc, **kwargs))
    assert torch.equal(got, ref)
    new = ref.shape[1] - enc["input_ids"].shape[1]
    assert new < 20 and len(steps) >= new - 1  # the loop ran on the sync-free step
    assert len(steps) < max_new_tokens  # never a step for a token past the length asked
