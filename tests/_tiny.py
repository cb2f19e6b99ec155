"""Tiny BriLLM models and tokenizers for the generation / evaluation / publishing tests (V <= 64, d = 8).

The tokenizer is character-level, built here with `tokenizers` directly the way the project's `kind="char"`
tokenizer is (WordLevel over single characters, space included, Fuse decoder), so these tests depend on nothing
but the model package. Specials follow the project's scheme: <pad>=0 <unk>=1 <s>=2 </s>=3, <s> prepended.
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from modeling_brillm import BriLLMForCausalLM

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]

CORPUS = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat saw a dog",
    "the dog saw the cat on the mat",
    "a bird sang in the tree",
    "the bird saw a cat in the tree",
    "my cat likes the warm mat",
    "your dog likes a long walk",
    "the cat and the dog are friends",
    "a small bird and a big dog",
]
CHARS = sorted({c for line in CORPUS for c in line})


def make_tokenizer(model_max_length: int = 64) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=model_max_length,
    )


def corpus_ids(tokenizer) -> list[torch.Tensor]:
    """Every corpus line as <s> w1 ... wn </s>."""
    return [torch.tensor(tokenizer(line)["input_ids"] + [EOS]) for line in CORPUS]


def make_model(tokenizer=None, dense: bool = False, node_size: int = 8, max_positions: int = 64, seed: int = 0,
               vocab_size: int | None = None, **config) -> BriLLMForCausalLM:
    tokenizer = tokenizer or make_tokenizer()
    torch.manual_seed(seed)
    V = vocab_size or len(tokenizer)
    model = BriLLMForCausalLM.from_token_sequences(
        corpus_ids(tokenizer), vocab_size=V, node_size=node_size, min_count=1, dense=dense,
        max_position_embeddings=max_positions, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        unk_token_id=UNK, **config,
    )
    # a few steps of training so the energies prefer the corpus bigrams (deterministic, < 1 s)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    batch = torch.nn.utils.rnn.pad_sequence(corpus_ids(tokenizer), batch_first=True, padding_value=PAD)
    mask = (torch.arange(batch.shape[1]) < torch.tensor([len(s) for s in corpus_ids(tokenizer)]).unsqueeze(1)).long()
    model.train()
    for _ in range(30):
        loss = model(batch, attention_mask=mask, labels=batch, return_logits=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    return model


def save_tiny(directory, dense: bool = False, **kwargs):
    """Save a tiny trained model + tokenizer into `directory`; returns (model, tokenizer)."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, dense=dense, **kwargs)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def assert_decodes_like_forward(model, row: torch.Tensor, prefix: int = 3):
    """Decoding `row` (1, T) one token at a time after a `prefix`-token prefill gives the teacher-forced logits, on
    the general one-token path, the sync-free step and "auto" (on the CPU the host step, one row)."""
    full = model(row).logits
    with torch.no_grad():
        for mode in ("off", "eager", "auto"):
            model.decode_mode = mode
            try:
                state = model(row[:, :prefix], use_cache=True).state
                for t in range(prefix, row.shape[1]):
                    out = model(row[:, t:t + 1], cache=state, use_cache=True)
                    torch.testing.assert_close(out.logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
                    state = out.state
            finally:
                model.decode_mode = "auto"


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str = ""):
    """Bit for bit on the CPU, where both sides run the same arithmetic in the same order. On CUDA two sides may run
    different kernels (a batch against one row, the scan against the decode step) and atomics add in any order, so
    float32 rounding may differ: within 1e-5 there."""
    if got.device.type == "cpu":
        assert torch.equal(got, expected), what
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * max(1.0, float(expected.abs().max())),
                                   msg=lambda m: f"{what}: {m}")
