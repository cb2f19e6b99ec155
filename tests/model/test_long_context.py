"""Unbounded context (`position_overflow="extend"`) and the position limit of generation (`"error"`)."""

import pytest
import torch
from _tiny import BOS, EOS, make_model, make_tokenizer
from transformers import pipeline

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM

M = 40  # trained range of the tiny model (its corpus lines are up to 33 tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer, device):
    model = make_model(tokenizer, max_positions=M)
    with torch.no_grad():
        # distinct mix weights, so reusing the last one past the range is really tested
        model.base_model.positions.normal_()
    return model.to(device)


@pytest.fixture()
def extended(model):
    model.config.position_overflow = "extend"
    yield model
    model.config.position_overflow = "error"


def random_ids(length, rows=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 24, (rows, length), generator=g)


def test_config_field():
    assert BriLLMConfig(graph="dense", vocab_size=4).position_overflow == "error"
    with pytest.raises(ValueError, match=r"position_overflow must be one of \('error', 'extend'\), got 'wrap'"):
        BriLLMConfig(graph="dense", vocab_size=4, position_overflow="wrap")


def test_nothing_changes_inside_the_trained_range(model):
    ids = random_ids(M)
    with torch.no_grad():
        before = model(ids).logits
        model.config.position_overflow = "extend"
        try:
            after = model(ids).logits
        finally:
            model.config.position_overflow = "error"
    assert torch.equal(before, after)


def test_error_mode_refuses_long_input_with_the_fix_named(model):
    with pytest.raises(ValueError, match='exceeds max_position_embeddings=40.*position_overflow="extend"'):
        model(random_ids(M + 1))


def test_teacher_forced_logits_of_2000_tokens_equal_incremental(extended):
    model = extended
    ids = random_ids(2000, rows=1)
    with torch.no_grad():
        full = model(ids)
        out = model(ids[:, :1], use_cache=True)
        state, steps = out.state, [out.logits[:, -1]]
        for t in range(1, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=state, use_cache=True)
            state = out.state
            steps.append(out.logits[:, -1])
    incremental = torch.stack(steps, 1)
    # the same recurrence and energies, summed in another order (one row's decode step mixes on the host): no drift
    # over 2000 tokens beyond float32 rounding
    torch.testing.assert_close(full.state.signal, state.signal, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full.state.mix_sum, state.mix_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.logits, incremental, atol=1e-5, rtol=1e-5)
    assert torch.equal(full.logits.argmax(-1), incremental.argmax(-1))
    # positions past the range really are read: the last position weight is reused, PE continues
    assert full.logits[0, M:].abs().sum() > 0 and not torch.allclose(full.logits[0, -1], full.logits[0, M])


def test_reading_past_the_range_uses_the_last_weight_and_the_pe_formula(extended):
    """A hand-made recurrence over positions past the range, from the state at position M − 1."""
    model = extended
    ids = random_ids(M + 5, rows=1)[0]
    with torch.no_grad():
        state = model(ids[None, :M], use_cache=True).state
        signal, mix_sum, mix_norm = state.signal[0].double(), state.mix_sum[0].double(), state.mix_norm[0].double()
        mix_max = state.mix_max[0].double()
        from modeling_brillm import positional_encoding

        last_weight = model.base_model.positions.view(-1)[-1].double()
        for i in range(M, M + 5):
            row = model.edge_rows(ids[i - 1:i], ids[i:i + 1])[0]
            pe = positional_encoding(torch.tensor([i], device=model.device), model.config.node_size,
                                     model.config.position_encoding)[0]
            out = torch.nn.functional.gelu(signal @ model.base_model.weights[row].double()
                                           + model.base_model.biases[row, 0].double()
                                           + pe.double())
            new_max = torch.maximum(mix_max, last_weight)
            mix_sum = mix_sum * torch.exp(mix_max - new_max) + torch.exp(last_weight - new_max) * out
            mix_norm = mix_norm * torch.exp(mix_max - new_max) + torch.exp(last_weight - new_max)
            mix_max, signal = new_max, mix_sum / mix_norm
        got = model(ids[None], use_cache=True).state.signal[0]
    torch.testing.assert_close(got.double(), signal, atol=1e-5, rtol=1e-5)


def test_generate_and_energy_generate_run_past_the_range(extended, tokenizer):
    model = extended
    prompt = torch.tensor([[BOS] + tokenizer("the cat").input_ids[1:]])
    model.generation_config.eos_token_id = None  # no stop: 300 tokens, most of them past the range
    try:
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=300, do_sample=False)
            energy = model.energy_generate(prompt, max_new_tokens=300, eos_token_id=[], exclude_self_loops=False)
    finally:
        model.generation_config.eos_token_id = EOS
    assert gen.shape == (1, prompt.shape[1] + 300)
    assert torch.equal(gen, energy.sequences)
    # the generated sequence read whole (teacher forcing) picks the same greedy tokens past the range
    with torch.no_grad():
        logits = model(gen[:, :-1]).logits
    greedy = logits.argmax(-1)[0, prompt.shape[1] - 1:]
    assert torch.equal(greedy, gen[0, prompt.shape[1]:])
    # a prompt longer than the range, and generate()'s default length (transformers would cap it at the range)
    long_prompt = random_ids(M + 10, rows=1)
    with torch.no_grad():
        assert model.generate(long_prompt, do_sample=False, eos_token_id=None).shape[1] == M + 10 + 20
        assert model.energy_generate(long_prompt, max_new_tokens=5).sequences.shape[1] == M + 15


def test_pipeline_reads_past_the_range(extended, tokenizer, tmp_path):
    extended.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.position_overflow == "extend"
    pipe = pipeline("text-generation", model=str(tmp_path), trust_remote_code=True, device=extended.device)
    text = pipe("the cat sat on the mat " * 3, max_new_tokens=60, min_new_tokens=60, do_sample=False,
                return_full_text=False)[0]["generated_text"]
    assert len(text) >= 50  # character tokens: 60 new ones (a few may decode to nothing)


# ------------------------------------------------------------------------------------------- the limit
class CountingForward:
    def __init__(self, model):
        self.model, self.calls = model, 0

    def __enter__(self):
        original = self.model.forward

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        self.model.forward = counted
        return self

    def __exit__(self, *exc):
        del self.model.forward


def test_generate_refuses_before_generating(model):
    prompt = random_ids(10, rows=1)
    with CountingForward(model) as counter:
        with pytest.raises(ValueError, match=f"at most {M - 10} new tokens fit.*position_overflow"):
            model.generate(prompt, max_new_tokens=M, do_sample=False)
        with pytest.raises(ValueError, match=f"at most {M - 10} new tokens fit"):
            model.energy_generate(prompt, max_new_tokens=M - 9)
        with pytest.raises(ValueError, match=f"more than max_position_embeddings={M}"):
            model.generate(random_ids(M + 1, rows=1), max_new_tokens=1)
    assert counter.calls == 0
    # exactly what fits is generated
    with torch.no_grad():
        assert model.generate(prompt, max_new_tokens=M - 10, min_new_tokens=M - 10, do_sample=False).shape[1] == M


def test_generate_limit_counts_real_tokens_not_padding(model):
    # two left-padded rows of 6 and 8 real tokens in 12 columns: 32 new tokens fit, not 28
    ids = random_ids(12)
    mask = torch.ones_like(ids)
    mask[0, :6], mask[1, :4] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=M - 8, min_new_tokens=M - 8, do_sample=False,
                             pad_token_id=0)
    assert out.shape[1] == 12 + M - 8
    with pytest.raises(ValueError, match=f"a prompt of 8 tokens plus max_new_tokens={M - 7}.*at most {M - 8}"):
        model.generate(ids, attention_mask=mask, max_new_tokens=M - 7, do_sample=False, pad_token_id=0)
