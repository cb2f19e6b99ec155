"""Generation: transformers' generate() and pipeline on BriLLM, and BriLLM's own energy decoding (energy_generate)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _tiny import BOS, EOS, PAD, make_model, make_tokenizer, save_tiny
from transformers import TextStreamer, pipeline

from modeling_brillm.decoding import EnergyGenerateOutput, energy_generate, save_custom_generate

PROMPTS = ["the cat", "a dog saw the", "my"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def model(tokenizer, device):
    return make_model(tokenizer).to(device)


@pytest.fixture(scope="module")
def dense_model(tokenizer, device):
    return make_model(tokenizer, dense=True, seed=1).to(device)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_brillm")
    model, tokenizer = save_tiny(directory)
    return directory, model, tokenizer


@pytest.fixture(scope="module")
def pipe(saved, device):
    directory, _, _ = saved
    return pipeline("text-generation", model=str(directory), trust_remote_code=True, device=device)


def batch(tokenizer, prompts=PROMPTS, side="left"):
    tokenizer.padding_side = side
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    tokenizer.padding_side = "left"
    return enc


def alone(tokenizer, prompt):
    return tokenizer([prompt], return_tensors="pt")


def strip_pad(row: torch.Tensor) -> list[int]:
    return [t for t in row.tolist() if t != PAD]


# ------------------------------------------------------------------------------------ standard generate()
def test_generate_greedy_batched_left_padding_equals_single_rows(model, tokenizer):
    enc = batch(tokenizer)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert out.shape[0] == len(PROMPTS) and out.shape[1] <= enc.input_ids.shape[1] + 12
    for r, prompt in enumerate(PROMPTS):
        single = model.generate(**alone(tokenizer, prompt), max_new_tokens=12, do_sample=False)
        assert strip_pad(out[r]) == strip_pad(single[0])


def test_generate_sampling_top_k_top_p_reproducible(model, tokenizer):
    enc = batch(tokenizer)
    kwargs = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=5, top_p=0.9)
    torch.manual_seed(0)
    a = model.generate(**enc, **kwargs)
    torch.manual_seed(0)
    b = model.generate(**enc, **kwargs)
    assert torch.equal(a, b)
    assert int(a.max()) < model.config.vocab_size
    # top_k=1 sampling is greedy
    greedy = model.generate(**enc, max_new_tokens=10, do_sample=False)
    one = model.generate(**enc, max_new_tokens=10, do_sample=True, top_k=1)
    assert torch.equal(greedy, one)


def test_generate_beam_search_batched_equals_single_rows(model, tokenizer):
    enc = batch(tokenizer)
    out = model.generate(**enc, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=PAD)
    for r, prompt in enumerate(PROMPTS):
        single = model.generate(**alone(tokenizer, prompt), max_new_tokens=8, num_beams=3, do_sample=False)
        # (beam search fills finished rows with eos, not pad: transformers' `pad_token_id or eos` with pad id 0)
        assert [t for t in strip_pad(out[r]) if t != EOS] == [t for t in strip_pad(single[0]) if t != EOS]
    two = model.generate(**alone(tokenizer, "the"), max_new_tokens=6, num_beams=3, num_return_sequences=2,
                         do_sample=False)
    assert two.shape[0] == 2 and not torch.equal(two[0], two[1])


# --------------------------------------------------------------------------------------------- pipeline
def test_pipeline_greedy_matches_generate(pipe, saved):
    _, model, tokenizer = saved
    text = pipe("the cat", max_new_tokens=10, do_sample=False)[0]["generated_text"]
    ids = model.generate(**alone(tokenizer, "the cat"), max_new_tokens=10, do_sample=False)
    assert text == tokenizer.decode(ids[0], skip_special_tokens=True)
    assert text.startswith("the cat") and len(text) > len("the cat")


def test_pipeline_batch_sampling_and_max_new_tokens(pipe, saved):
    _, _, tokenizer = saved
    results = pipe(PROMPTS, max_new_tokens=5, do_sample=False, batch_size=3)
    assert len(results) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        text = result[0]["generated_text"]
        assert text.startswith(prompt)
        assert len(tokenizer(text, add_special_tokens=False).input_ids) <= len(prompt) + 5
    single = [pipe(p, max_new_tokens=5, do_sample=False)[0]["generated_text"] for p in PROMPTS]
    assert [r[0]["generated_text"] for r in results] == single
    torch.manual_seed(0)
    sampled = pipe("the", max_new_tokens=6, do_sample=True, top_k=4, num_return_sequences=3)
    assert len(sampled) == 3 and all(s["generated_text"].startswith("the") for s in sampled)
    # exactly max_new_tokens when no eos can stop it
    no_eos = pipe("the", max_new_tokens=7, do_sample=False, eos_token_id=None, return_full_text=False)
    assert len(tokenizer(no_eos[0]["generated_text"], add_special_tokens=False).input_ids) == 7


class _Capture(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.pieces = []

    def on_finalized_text(self, text, stream_end=False):
        self.pieces.append(text)


def test_pipeline_streaming(pipe, saved):
    _, _, tokenizer = saved
    streamer = _Capture(tokenizer)
    text = pipe("the cat", max_new_tokens=10, do_sample=False, streamer=streamer, return_full_text=False)
    assert "".join(streamer.pieces) == text[0]["generated_text"]
    assert len(streamer.pieces) >= 1


def test_pipeline_stop_strings(pipe, saved):
    _, _, tokenizer = saved
    full = pipe("the cat", max_new_tokens=30, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert len(full) >= 6
    stop = full[3:5]  # a string the greedy continuation contains
    cut = pipe("the cat", max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer,
               return_full_text=False)[0]["generated_text"]
    assert cut.endswith(stop) and len(cut) < len(full) and full.startswith(cut)


# ------------------------------------------------------------------------------------- energy_generate
def test_energy_generate_greedy_equals_generate_without_self_loop_exclusion(model, tokenizer):
    enc = batch(tokenizer)
    ref = model.generate(**enc, max_new_tokens=20, do_sample=False)
    out = energy_generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=20, exclude_self_loops=False)
    assert isinstance(out, EnergyGenerateOutput)
    assert torch.equal(out.sequences, ref)
    # one row stops at eos, the others run to the end: finished steps are masked and padded
    assert bool((~out.step_mask).any()) and bool(out.step_mask[:, 0].all())
    for r in range(len(PROMPTS)):
        n = int(out.step_mask[r].sum())
        assert len(out.path(r)) == n
        assert bool((out.tokens[r, n:] == PAD).all()) and bool(torch.isnan(out.energies[r, n:]).all())


def test_energy_generate_dense_graph_equals_generate(dense_model, tokenizer):
    enc = batch(tokenizer)
    ref = dense_model.generate(**enc, max_new_tokens=12, do_sample=False)
    out = energy_generate(dense_model, enc.input_ids, enc.attention_mask, max_new_tokens=12, exclude_self_loops=False)
    assert torch.equal(out.sequences, ref)


def test_energy_path_equals_teacher_forced_logits(model, tokenizer):
    enc = batch(tokenizer)
    out = energy_generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=15, num_alternatives=4)
    with torch.no_grad():
        logits = model(out.sequences, attention_mask=out.attention_mask).logits
    T = out.prompt_length
    checked = 0
    for r in range(out.sequences.shape[0]):
        for s in range(out.num_steps):
            if not out.step_mask[r, s]:
                continue
            row = logits[r, T + s - 1]  # energies of every node as the successor of the previous token
            token = int(out.tokens[r, s])
            assert int(out.sources[r, s]) == int(out.sequences[r, T + s - 1])
            assert math.isclose(float(out.energies[r, s]), float(row[token]), rel_tol=1e-5, abs_tol=1e-5)
            assert int(out.ranks[r, s]) == 1 + int((row > row[token]).sum())
            others = row.clone()
            others[token] = float("-inf")
            top = others.topk(4).values
            assert torch.allclose(out.alternative_energies[r, s], top, atol=1e-5)
            assert all(int(t) != token for t in out.alternative_tokens[r, s])
            checked += 1
    assert checked > 20
    # greedy with self-loop exclusion: every choice is the best node other than the source itself
    row_steps = out.path(0, tokenizer)
    assert all(step.rank <= 2 for step in row_steps)
    assert out.positions[0, 0] == int(enc.attention_mask[0].sum())


def test_energy_generate_records_are_json(model, tokenizer):
    out = energy_generate(model, alone(tokenizer, "the cat").input_ids, max_new_tokens=5, tokenizer=tokenizer)
    records = out.to_records()
    text = json.dumps(records)
    assert len(records) == 1 and len(records[0]) == out.num_steps
    first = records[0][0]
    assert {"step", "position", "source", "token", "energy", "rank", "probability", "alternatives"} <= set(first)
    assert first["token_text"] == tokenizer.decode([first["token"]]) and "text" in first["alternatives"][0]
    assert "NaN" not in text


def test_energy_generate_right_padding_is_realigned(model, tokenizer):
    left = batch(tokenizer, side="left")
    right = batch(tokenizer, side="right")
    a = energy_generate(model, left.input_ids, left.attention_mask, max_new_tokens=8)
    b = energy_generate(model, right.input_ids, right.attention_mask, max_new_tokens=8)
    assert torch.equal(a.sequences, b.sequences)
    assert torch.allclose(a.energies, b.energies, equal_nan=True)


def test_self_loops_excluded_when_asked(tokenizer, device):
    model = make_model(tokenizer, dense=True, seed=1).to(device)
    V = model.config.vocab_size
    with torch.no_grad():  # every edge output = GeLU(b + PE); every self-loop u→u delivers by far the most energy
        model.base_model.weights.zero_()
        for u in range(V):
            model.base_model.biases[1 + u * V + u].fill_(10.0)
    ids = alone(tokenizer, "the cat").input_ids
    kept = energy_generate(model, ids, max_new_tokens=6, exclude_self_loops=False, eos_token_id=[])
    assert bool((kept.tokens == kept.sources).all())  # stuck on the last node
    excluded = energy_generate(model, ids, max_new_tokens=6, exclude_self_loops=True, eos_token_id=[])
    assert not bool((excluded.tokens == excluded.sources).any())
    assert bool((excluded.ranks == 2).all())  # the self-loop is rank 1, the choice the best other node
    torch.manual_seed(0)
    sampled = energy_generate(model, ids.repeat(16, 1), max_new_tokens=4, do_sample=True, temperature=5.0,
                              exclude_self_loops=True, eos_token_id=[])
    assert not bool((sampled.tokens == sampled.sources).any())


def test_temperature_changes_the_sampling_distribution(model, tokenizer):
    ids = alone(tokenizer, "the ").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    n = 4000
    rows = ids.repeat(n, 1)
    empirical = {}
    for temperature in (0.5, 1.0, 3.0):
        gen = torch.Generator(device=model.device).manual_seed(1)
        out = energy_generate(model, rows, max_new_tokens=1, do_sample=True, temperature=temperature,
                              exclude_self_loops=False, generator=gen, num_alternatives=0)
        counts = torch.bincount(out.tokens[:, 0], minlength=logits.numel()).float() / n
        expected = torch.softmax(logits / temperature, dim=-1)
        assert (counts - expected).abs().max() < 0.04, temperature
        # the recorded probability is the tempered one
        assert torch.allclose(out.probabilities[:, 0], expected[out.tokens[:, 0]], atol=1e-5)
        empirical[temperature] = counts
    entropy = {t: float(-(c[c > 0] * c[c > 0].log()).sum()) for t, c in empirical.items()}
    assert entropy[0.5] < entropy[1.0] < entropy[3.0]


def test_sampling_top_k_top_p_and_generator(model, tokenizer):
    ids = alone(tokenizer, "the ").input_ids.repeat(300, 1)
    with torch.no_grad():
        logits = model(ids[:1]).logits[0, -1]
    out = energy_generate(model, ids, max_new_tokens=1, do_sample=True, top_k=2, exclude_self_loops=False,
                          generator=torch.Generator(device=model.device).manual_seed(0))
    assert set(out.tokens[:, 0].tolist()) <= set(logits.topk(2).indices.tolist())
    probs = torch.softmax(logits, -1)
    out = energy_generate(model, ids, max_new_tokens=1, do_sample=True, top_p=0.5, exclude_self_loops=False,
                          generator=torch.Generator(device=model.device).manual_seed(0))
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1]
    assert set(out.tokens[:, 0].tolist()) <= set(nucleus.tolist())
    a = energy_generate(model, ids[:4], max_new_tokens=6, do_sample=True,
                        generator=torch.Generator(device=model.device).manual_seed(3))
    b = energy_generate(model, ids[:4], max_new_tokens=6, do_sample=True,
                        generator=torch.Generator(device=model.device).manual_seed(3))
    assert torch.equal(a.sequences, b.sequences)


def test_repetition_controls(model, tokenizer):
    ids = alone(tokenizer, "the cat").input_ids
    out = energy_generate(model, ids, max_new_tokens=40, no_repeat_ngram_size=3, eos_token_id=[])
    seq = out.sequences[0].tolist()
    trigrams = [tuple(seq[i:i + 3]) for i in range(len(seq) - 2)]
    assert len(trigrams) == len(set(trigrams))
    plain = energy_generate(model, ids, max_new_tokens=40, eos_token_id=[])
    penalised = energy_generate(model, ids, max_new_tokens=40, eos_token_id=[], repetition_penalty=3.0)
    assert len(set(penalised.tokens[0].tolist())) >= len(set(plain.tokens[0].tolist()))
    assert not torch.equal(plain.tokens, penalised.tokens)


# ----------------------------------------------------------------------- energy_generate: stop strings, beams
def test_energy_generate_stop_strings_end_rows_independently(model, tokenizer):
    enc = batch(tokenizer)
    full = energy_generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=30, exclude_self_loops=False)
    texts = [tokenizer.decode(full.tokens[r][full.step_mask[r]]) for r in range(len(PROMPTS))]
    stops = ["aw t", "og l"]  # row 0 meets the first, row 1 the second, row 2 neither before its eos
    out = energy_generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=30, exclude_self_loops=False,
                          stop_strings=stops, tokenizer=tokenizer)
    # the same rows as generate(stop_strings=...) with the same tokenizer
    ref = model.generate(**enc, max_new_tokens=30, do_sample=False, stop_strings=stops, tokenizer=tokenizer)
    assert torch.equal(out.sequences, ref)
    ended = [int(out.step_mask[r].sum()) for r in range(len(PROMPTS))]
    for r, text in enumerate(texts):
        cut = tokenizer.decode(out.tokens[r, :ended[r]])
        assert text.startswith(cut) and len(out.path(r)) == ended[r]
        first = min((i for i in (text.find(t) for t in stops) if i >= 0), default=None)
        if first is None:
            assert cut == text  # no stop string: the row runs to its eos as before
        else:  # the row ends with the token that completes the earliest stop string
            end = min(text.find(t) + len(t) for t in stops if t in text)
            assert len(cut) >= end and len(tokenizer.decode(out.tokens[r, :ended[r] - 1])) < end
            assert bool((out.tokens[r, ended[r]:] == PAD).all())
    cut_short = [ended[r] < int(full.step_mask[r].sum()) for r in range(len(PROMPTS))]
    assert any(cut_short) and not all(cut_short)
    # a string completed across the prompt boundary counts, one already in the prompt does not
    one = energy_generate(model, alone(tokenizer, "the ca").input_ids, max_new_tokens=5, stop_strings="cat",
                          tokenizer=tokenizer, exclude_self_loops=False)
    assert tokenizer.decode(one.tokens[0]) == "t" and one.num_steps == 1
    assert energy_generate(model, alone(tokenizer, "the cat").input_ids, max_new_tokens=3, stop_strings="cat",
                           tokenizer=tokenizer, eos_token_id=[]).num_steps == 3


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping", [(2, 1.0, False), (3, 0.0, "never"),
                                                                     (4, 2.0, True), (3, -1.0, False)])
def test_energy_beam_search_equals_generate_beam_search(model, tokenizer, num_beams, length_penalty, early_stopping):
    enc = batch(tokenizer)
    kwargs = dict(max_new_tokens=12, num_beams=num_beams, num_return_sequences=2, length_penalty=length_penalty,
                  early_stopping=early_stopping)
    ref = model.generate(**enc, do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs)
    out = energy_generate(model, enc.input_ids, enc.attention_mask, exclude_self_loops=False, **kwargs)
    T = out.prompt_length
    for r in range(out.sequences.shape[0]):  # generate() fills ended beams with eos (pad id 0 reads as unset)
        n = int(out.step_mask[r].sum())
        assert torch.equal(out.sequences[r, :T + n], ref.sequences[r, :T + n])
        assert set(ref.sequences[r, T + n:].tolist()) <= {EOS, PAD} and bool((out.tokens[r, n:] == PAD).all())
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-5, rtol=1e-5)


def test_energy_beam_paths_match_the_returned_tokens(model, tokenizer):
    enc = batch(tokenizer)
    out = energy_generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=14, num_beams=4,
                          num_return_sequences=3, length_penalty=0.5, num_alternatives=3, repetition_penalty=1.3)
    assert out.sequences.shape[0] == 3 * len(PROMPTS) and out.energies.shape == out.tokens.shape
    with torch.no_grad():
        logits = model(out.sequences, attention_mask=out.attention_mask).logits
    T = out.prompt_length
    for r in range(out.sequences.shape[0]):
        steps = out.path(r)
        n = len(steps)
        assert n == int(out.step_mask[r].sum()) > 0
        assert [st.token for st in steps] == out.sequences[r, T:T + n].tolist()
        assert [st.source for st in steps] == out.sequences[r, T - 1:T + n - 1].tolist()
        for s, st in enumerate(steps):
            row = logits[r, T + s - 1]
            assert math.isclose(st.energy, float(row[st.token]), rel_tol=1e-5, abs_tol=1e-5)
            assert st.rank == 1 + int((row > row[st.token]).sum()) and st.token != st.source  # self-loops excluded
            others = row.scatter(0, torch.tensor([st.token], device=row.device), float("-inf"))
            assert torch.allclose(out.alternative_energies[r, s], others.topk(3).values, atol=1e-5)
        # the beam score is the path's log-probabilities, length-normalised
        score = sum(math.log(st.probability) for st in steps) / n ** 0.5
        assert math.isclose(score, float(out.sequences_scores[r]), rel_tol=1e-4, abs_tol=1e-5)
    assert bool((out.sequences_scores.view(len(PROMPTS), 3).diff(dim=1) <= 1e-6).all())  # best first per prompt


def test_energy_beam_search_scores_at_least_as_well_as_greedy(model, tokenizer):
    enc = batch(tokenizer).to(model.device)
    # fixed length (no eos), plain sums: a beam's best is at least as likely as the greedy path
    fixed = dict(max_new_tokens=16, eos_token_id=[], length_penalty=0.0)
    greedy = energy_generate(model, enc.input_ids, enc.attention_mask, **fixed)
    greedy_scores = greedy.probabilities.log().sum(1)
    better = 0
    for beams in (2, 4):
        out = energy_generate(model, enc.input_ids, enc.attention_mask, num_beams=beams, **fixed)
        assert bool((out.sequences_scores >= greedy_scores - 1e-5).all())
        better += int((out.sequences_scores > greedy_scores + 1e-4).sum())
    assert better > 0


def test_energy_generate_stop_strings_and_beams_bad_arguments(model, tokenizer):
    ids = torch.tensor([[BOS, 5]])
    with pytest.raises(ValueError, match="stop_strings needs the model's tokenizer"):
        energy_generate(model, ids, stop_strings=["cat"])
    with pytest.raises(ValueError, match="non-empty string"):
        energy_generate(model, ids, stop_strings=[""], tokenizer=tokenizer)
    with pytest.raises(ValueError, match="num_beams must be a positive integer"):
        energy_generate(model, ids, num_beams=0)
    with pytest.raises(ValueError, match="do_sample=False"):
        energy_generate(model, ids, num_beams=2, do_sample=True)
    with pytest.raises(ValueError, match=r"smaller or equal to `num_beams` \(2\)"):
        energy_generate(model, ids, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="repeat the prompt rows"):
        energy_generate(model, ids, num_return_sequences=2)
    with pytest.raises(ValueError, match="streamer"):
        energy_generate(model, ids, num_beams=2, streamer=_Capture(tokenizer))
    with pytest.raises(ValueError, match="early_stopping"):
        energy_generate(model, ids, num_beams=2, early_stopping="sometimes")
    zero = energy_generate(model, ids, num_beams=3, max_new_tokens=0)
    assert zero.sequences.tolist() == [[BOS, 5]] and zero.num_steps == 0


def test_energy_generate_streamer(model, tokenizer):
    streamer = _Capture(tokenizer)
    out = energy_generate(model, alone(tokenizer, "the cat").input_ids, max_new_tokens=8, streamer=streamer)
    new_text = tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    assert "".join(streamer.pieces) == new_text


def test_custom_generate_folder(model, tokenizer, tmp_path):
    path = save_custom_generate(tmp_path)
    assert path.endswith("custom_generate/generate.py")
    ids = alone(tokenizer, "the cat")
    via_generate = model.generate(**ids, custom_generate=str(tmp_path), trust_remote_code=True, max_new_tokens=10,
                                  exclude_self_loops=True)
    direct = energy_generate(model, ids.input_ids, ids.attention_mask, max_new_tokens=10)
    assert torch.equal(via_generate, direct.sequences)
    # generate()'s beam and stop-string arguments reach energy_generate
    kwargs = dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, length_penalty=0.5, stop_strings=["at"])
    via_generate = model.generate(**ids, custom_generate=str(tmp_path), trust_remote_code=True, tokenizer=tokenizer,
                                  **kwargs)
    direct = energy_generate(model, ids.input_ids, ids.attention_mask, tokenizer=tokenizer, **kwargs)
    assert direct.sequences.shape[0] == 2 and torch.equal(via_generate, direct.sequences)
    # the standard loop is untouched
    assert torch.equal(model.generate(**ids, max_new_tokens=10, do_sample=False),
                       energy_generate(model, ids.input_ids, max_new_tokens=10, exclude_self_loops=False).sequences)


# ------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_have_clear_errors(model, tokenizer):
    M = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="empty prompt"):
        energy_generate(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty prompt"):
        energy_generate(model, [])
    with pytest.raises(ValueError, match="all zeros"):
        energy_generate(model, torch.tensor([[BOS, 5]]), attention_mask=torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="more than max_position_embeddings"):
        energy_generate(model, torch.full((1, M + 3), 5), max_new_tokens=1)
    with pytest.raises(ValueError, match=f"at most {M - 10} new tokens fit"):
        energy_generate(model, torch.full((1, 10), 5), max_new_tokens=M)
    out = energy_generate(model, torch.full((1, 10), 5), max_new_tokens=M - 10, eos_token_id=[])
    assert out.sequences.shape[1] == M  # exactly up to the last position
    with pytest.raises(ValueError, match="outside the vocabulary"):
        energy_generate(model, torch.tensor([[BOS, model.config.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        energy_generate(model, torch.tensor([[-1, 5]]))
    with pytest.raises(TypeError, match="integer"):
        energy_generate(model, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="temperature"):
        energy_generate(model, torch.tensor([[BOS]]), do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        energy_generate(model, torch.tensor([[BOS]]), max_new_tokens=-1)
    zero = energy_generate(model, torch.tensor([[BOS, 5]]), max_new_tokens=0)
    assert zero.sequences.tolist() == [[BOS, 5]] and zero.num_steps == 0
    # a single BOS is a valid (unconditional) prompt; 1-D input is one row
    assert energy_generate(model, torch.tensor([BOS]), max_new_tokens=3).sequences.shape == (1, 4)
    # the standard generate() fails with the model's own clear message, not deep in torch
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(torch.full((1, 10), 5), max_new_tokens=M, min_new_tokens=M, do_sample=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate(torch.tensor([[BOS, 999]]), max_new_tokens=2)


def test_pipeline_bad_input(pipe):
    # too long for the model: the model's own ValueError, raised before or during generation
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        pipe("the cat " * 10, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        pipe("the cat " * 5, max_new_tokens=40, do_sample=False, eos_token_id=None)
    # an empty prompt is the BOS token alone: an unconditional sample
    text = pipe("", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert isinstance(text, str) and 0 < len(text) <= 3


def test_generate_example_script(saved, capsys, tmp_path):
    from modeling_brillm.training.generate_cli import main  # what examples/generate.py runs

    directory, _, _ = saved
    M = 64
    assert main(["--model", str(directory), "--prompt", "the cat", "--max_new_tokens", "6", "--show_path",
                 "--json", str(tmp_path / "g.json")]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("the cat") and "energy" in out.out and "rank" in out.out
    assert json.loads((tmp_path / "g.json").read_text())["paths"][0][0]["rank"] >= 1
    # empty prompt: starts from BOS; too many new tokens: lowered, with a note
    assert main(["--model", str(directory), "--prompt", "", "--max_new_tokens", "500"]) == 0
    out = capsys.readouterr()
    assert "lowered to" in out.err
    # prompt longer than the model reads: clear error, exit code 2
    assert main(["--model", str(directory), "--prompt", "the cat " * 20]) == 2
    assert f"max_position_embeddings={M}" in capsys.readouterr().err
    for mode in ("generate", "pipeline"):
        assert main(["--model", str(directory), "--prompt", "the cat", "a dog", "--mode", mode, "--max_new_tokens",
                     "5", "--stop", "t"]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("the cat")



def test_generate_example_extend_beams_and_stop_strings(saved, capsys, tmp_path):
    """examples/generate.py: with --extend nothing is cut at max_position_embeddings; energy mode runs beam search
    and stop strings with energy_generate's own results (texts, scores, one path per returned sequence)."""
    from modeling_brillm.training.generate_cli import main  # what examples/generate.py runs

    directory, model, tokenizer = saved
    long_prompt = "the cat sat on the mat " * 4  # 97 tokens with <s>, past the 64 positions
    assert main(["--model", str(directory), "--prompt", long_prompt, "--max_new_tokens", "5"]) == 2
    assert "--extend" in capsys.readouterr().err
    assert main(["--model", str(directory), "--prompt", long_prompt, "--max_new_tokens", "5", "--extend",
                 "--json", str(tmp_path / "long.json")]) == 0
    out = capsys.readouterr()
    assert "lowered" not in out.err and out.out.startswith(long_prompt.rstrip())
    assert len(json.loads((tmp_path / "long.json").read_text())["paths"][0]) >= 1

    prompts = ["the cat", "a dog"]
    assert main(["--model", str(directory), "--prompt", *prompts, "--max_new_tokens", "8", "--num_beams", "3",
                 "--num_return_sequences", "2", "--length_penalty", "0.5", "--stop_strings", "t", "--show_path",
                 "--json", str(tmp_path / "beams.json")]) == 0
    out = capsys.readouterr().out
    saved_json = json.loads((tmp_path / "beams.json").read_text())
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    expected = energy_generate(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=8, num_beams=3,
                               num_return_sequences=2, length_penalty=0.5, stop_strings="t", tokenizer=tokenizer)
    texts = tokenizer.batch_decode(expected.sequences, skip_special_tokens=True)
    assert saved_json["texts"] == texts and len(texts) == 4
    assert saved_json["sequences_scores"] == pytest.approx(expected.sequences_scores.tolist())
    assert saved_json["paths"] == expected.to_records(tokenizer)
    assert out.count("beam score") == 4 and all(t in out for t in texts)
    for row, text in enumerate(texts):  # each new part ends at the first "t" it makes, or runs to 8 tokens
        new = text[len(prompts[row // 2]):]
        path = saved_json["paths"][row]
        assert "t" not in new[:-1] and (new.endswith("t") or len(path) == 8 or path[-1]["token"] == EOS)
    # bad combinations are refused with energy_generate's message, exit code 2
    assert main(["--model", str(directory), "--prompt", "the", "--num_beams", "2", "--do_sample"]) == 2
    assert "do_sample" in capsys.readouterr().err
