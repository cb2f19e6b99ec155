"""The start signal as a parameter: config checks, a fresh learned start equals the release's uniform one bit for
bit, loading a uniform checkpoint as learned, per-row `signal_ids`, and their way through generate()."""

import pytest
import torch

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
from tests._tiny import BOS, EOS, make_model, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def uniform(tok, device):
    return make_model(tok).to(device)


def as_learned(model, num_start_signals=1):
    """A learned-start copy of `model` (same weights; start signals fresh from the config's init)."""
    config = BriLLMConfig.from_dict({**model.config.to_dict(), "start_signal": "learned",
                                     "num_start_signals": num_start_signals})
    learned = BriLLMForCausalLM(config)
    missing, unexpected = learned.load_state_dict(model.state_dict(), strict=False)
    assert missing == ["brillm.start_signals"] and not unexpected
    return learned.to(model.device).eval()


def batch(tok, texts=("the cat sat", "a dog saw the mat")):
    enc = tok(list(texts), padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("fields, message", [
    ({"start_signal": "prompt"}, "start_signal must be one of"),
    ({"start_signal": "uniform", "num_start_signals": 2}, "needs start_signal='learned'"),
    ({"start_signal": "learned", "num_start_signals": 0}, "num_start_signals must be a positive integer"),
])
def test_config_rejects_bad_start_signal(fields, message):
    with pytest.raises(ValueError, match=message):
        BriLLMConfig(vocab_size=8, graph="dense", **fields)


def test_parameter_count_includes_learned_signals():
    config = BriLLMConfig(vocab_size=6, node_size=4, graph="dense", max_position_embeddings=8,
                          start_signal="learned", num_start_signals=3)
    model = BriLLMForCausalLM(config)
    assert model.base_model.start_signals.shape == (3, 4)
    assert model.num_parameters() == config.num_parameters_formula()
    assert BriLLMForCausalLM(BriLLMConfig(vocab_size=6, node_size=4, graph="dense")).base_model.start_signals is None


def test_fresh_learned_start_equals_uniform_exactly(tok, uniform):
    learned = as_learned(uniform, num_start_signals=2)
    assert torch.equal(learned.base_model.start_signals.cpu(), torch.full((2, 8), 1 / 8))
    ids, mask = batch(tok)
    with torch.no_grad():
        a = uniform(ids, attention_mask=mask, labels=ids)
        b = learned(ids, attention_mask=mask, labels=ids)
        c = learned(ids, attention_mask=mask, labels=ids, signal_ids=torch.tensor([1, 0]))
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    assert torch.equal(a.logits, c.logits)


def test_uniform_checkpoint_loads_as_learned(tmp_path, tok, uniform):
    uniform.save_pretrained(tmp_path / "uniform")
    learned = BriLLMForCausalLM.from_pretrained(tmp_path / "uniform", start_signal="learned", num_start_signals=3)
    learned.to(uniform.device)
    assert learned.config.start_signal == "learned"
    # missing key: initialised to 1/d
    assert torch.equal(learned.base_model.start_signals.cpu(), torch.full((3, 8), 1 / 8))
    assert torch.equal(learned.base_model.weights, uniform.base_model.weights)  # loaded ones are not re-initialised
    ids, mask = batch(tok)
    with torch.no_grad():
        assert torch.equal(learned(ids, attention_mask=mask).logits, uniform(ids, attention_mask=mask).logits)
    # a trained start signal survives a save/load round trip
    with torch.no_grad():
        learned.base_model.start_signals[2] = torch.linspace(-1, 1, 8)
    learned.save_pretrained(tmp_path / "learned")
    again = BriLLMForCausalLM.from_pretrained(tmp_path / "learned")
    assert (again.config.num_start_signals == 3
            and torch.equal(again.base_model.start_signals, learned.base_model.start_signals.cpu()))


def test_signal_ids_pick_each_rows_start(tok, uniform):
    learned = as_learned(uniform, num_start_signals=3)
    with torch.no_grad():
        learned.base_model.start_signals[1] = torch.linspace(-2, 2, 8)
        learned.base_model.start_signals[2] = torch.linspace(2, -2, 8)
    ids, mask = batch(tok)
    with torch.no_grad():
        both = learned(ids, attention_mask=mask, signal_ids=torch.tensor([1, 2])).logits
        default = learned(ids, attention_mask=mask).logits
        for row, sid in enumerate([1, 2]):
            n = int(mask[row].sum())
            alone = learned(ids[row:row + 1, :n], signal_ids=torch.tensor([sid])).logits
            assert torch.allclose(both[row, :n], alone[0], atol=1e-5)
        # signal 0 is still the uniform start; the other signals change the path's energies
        assert torch.equal(default, uniform(ids, attention_mask=mask).logits)
        assert not torch.allclose(both, default)
        scalar = learned(ids, attention_mask=mask, signal_ids=1).logits
        assert torch.equal(scalar, learned(ids, attention_mask=mask, signal_ids=torch.tensor([1, 1])).logits)


def test_start_signal_gets_gradients(tok, uniform):
    learned = as_learned(uniform, num_start_signals=2).train()
    ids, mask = batch(tok)
    learned(ids, attention_mask=mask, labels=ids, signal_ids=torch.tensor([1, 1]), return_logits=False).loss.backward()
    assert (learned.base_model.start_signals.grad[0].abs().sum() == 0
            and learned.base_model.start_signals.grad[1].abs().sum() > 0)


@pytest.mark.parametrize("value, message", [
    (torch.tensor([0, 2]), r"signal_ids value 2 is outside \[0, 2\).*num_start_signals=2"),
    (torch.tensor([-1, 0]), r"signal_ids value -1 is outside"),
    (torch.tensor([0, 0, 0]), r"shape \(batch,\) = \(2,\)"),
    (torch.tensor([0.0, 1.0]), r"must be integer ids"),
])
def test_bad_signal_ids(tok, uniform, value, message):
    learned = as_learned(uniform, num_start_signals=2)
    ids, mask = batch(tok)
    with pytest.raises(ValueError, match=message):
        learned(ids, attention_mask=mask, signal_ids=value)


def test_signal_ids_on_uniform_model(tok, uniform):
    ids, mask = batch(tok)
    with pytest.raises(ValueError, match="start_signal='learned'"):
        uniform(ids, attention_mask=mask, signal_ids=torch.tensor([0, 0]))


def greedy_by_forward(model, prompt, signal_id, steps):
    """Reference decoding: rescore the whole sequence at every step."""
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(steps):
            logits = model(seq, signal_ids=torch.tensor([signal_id])).logits[0, -1]
            seq = torch.cat([seq, logits.argmax().view(1, 1)], 1)
    return seq


def test_signal_ids_reach_generate_and_energy_generate(tok, uniform):
    learned = as_learned(uniform, num_start_signals=2)
    with torch.no_grad():
        learned.base_model.start_signals[1] = torch.linspace(-3, 3, 8)
    prompt = torch.tensor([[BOS]], device=learned.device)
    expected = [greedy_by_forward(learned, prompt, sid, 6) for sid in (0, 1)]
    assert not torch.equal(expected[0], expected[1])  # the start signal alone changes the continuation
    for sid in (0, 1):
        out = learned.generate(prompt, signal_ids=torch.tensor([sid]), max_new_tokens=6, do_sample=False,
                               eos_token_id=[], pad_token_id=0)
        assert torch.equal(out, expected[sid])
        energy = learned.energy_generate(prompt, signal_ids=torch.tensor([sid]), max_new_tokens=6,
                                         exclude_self_loops=False, eos_token_id=[])
        assert torch.equal(energy.sequences, expected[sid])
    # a batch of two rows with different signals, expanded by num_return_sequences (top_k=1 sampling is greedy)
    out = learned.generate(prompt.expand(2, 1), signal_ids=torch.tensor([0, 1]), max_new_tokens=6, do_sample=True,
                           top_k=1, num_return_sequences=2, eos_token_id=[], pad_token_id=0)
    assert [torch.equal(out[i:i + 1], expected[i // 2]) for i in range(4)] == [True] * 4


def test_signal_ids_through_pipeline(tok, uniform):
    from transformers import pipeline

    learned = as_learned(uniform, num_start_signals=2)
    with torch.no_grad():
        learned.base_model.start_signals[1] = torch.linspace(-3, 3, 8)
    pipe = pipeline("text-generation", model=learned, tokenizer=tok)
    ids = tok("the", return_tensors="pt").input_ids
    texts = []
    for sid in (0, 1):
        text = pipe("the", signal_ids=torch.tensor([sid]), max_new_tokens=8, do_sample=False)[0]["generated_text"]
        direct = learned.generate(ids, signal_ids=torch.tensor([sid]), max_new_tokens=8, do_sample=False)
        assert text == tok.decode(direct[0], skip_special_tokens=True)
        texts.append(text)
    assert texts[0] != texts[1]


def test_signal_ids_reach_beam_search(tok, uniform):
    learned = as_learned(uniform, num_start_signals=2)
    with torch.no_grad():
        learned.base_model.start_signals[1] = torch.linspace(-3, 3, 8)
    prompt = torch.tensor([[BOS]])
    found = []
    for sid in (0, 1):
        beams = dict(max_new_tokens=6, num_beams=2, eos_token_id=EOS, pad_token_id=0)
        out = learned.generate(prompt, signal_ids=torch.tensor([sid]), do_sample=False, **beams)
        energy = learned.energy_generate(prompt, signal_ids=torch.tensor([sid]), exclude_self_loops=False, **beams)
        assert torch.equal(energy.sequences, out)
        found.append(out)
    assert not torch.equal(found[0], found[1])
