"""The explorer tests' models and texts: a tiny model whose vocabulary holds tokens a page must escape, a byte-level
BPE model over accented, Chinese and emoji text, random models on the released tokenizers at V = 4000, and a tiny
random model of V = 4000 nodes for a 2,000-token page."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _tiny import make_model, make_tokenizer

from modeling_brillm import BriLLMForCausalLM

# tokens that would run code, break an attribute or hide characters if the page inserted them as markup
TRICKY = ["<script>window.pwned=1</script>", '<img src=x onerror="window.pwned=2">', "\"it's\"", "\u202eevil", "\t",
          "\x07", "\n"]
TEXT = "the cat " + TRICKY[0] + " sat " + TRICKY[2] + " on" + TRICKY[1] + " the\tmat" + TRICKY[3] + "\x07\n"
# what the byte-level model reads: characters of two, three and four UTF-8 bytes, a zero-width and a bidi character
WORLD = ["the caf\u00e9 serves cr\u00e8me br\u00fbl\u00e9e na\u00efvely", "\u4e2d\u6587\u7684\u6587\u672c \u4f60\u597d",
         "emoji \U0001f600 and \U0001f680 fly", "zero\u200bwidth and \u202ereversed\u202c text",
         "the cat returns to the caf\u00e9", "\u4e16\u754c\u4f60\u597d returns"]
RELEASE = os.environ.get("BRILLM05_RELEASE")


def tricky_model():
    """(model, tokenizer): the tiny trained model with TRICKY added as nodes (reached through the shared edge)."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    tokenizer.add_tokens(TRICKY)
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():  # distinct position weights, so the signal's mix is no plain average
        model.brillm.positions.copy_(torch.linspace(-1.0, 2.0, model.brillm.positions.numel()).view_as(
            model.brillm.positions))
    return model.eval(), tokenizer


def random_model(tokenizer, lines, seed: int = 0, **config):
    """An untrained sparse model over `tokenizer`'s vocabulary, d = 4, its graph the bigrams of `lines`."""
    torch.manual_seed(seed)
    with_specials = [torch.tensor(tokenizer(line)["input_ids"]) for line in lines]
    ids = {k: getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    model = BriLLMForCausalLM.from_token_sequences(
        with_specials, vocab_size=len(tokenizer), node_size=4, min_count=1, max_position_embeddings=128,
        **{f"{k}_token_id": v for k, v in ids.items() if v is not None}, **config)
    return model.eval()


def byte_model():
    """(model, tokenizer): a 300-token byte-level BPE tokenizer (build_tokenizer, as make demo builds one) trained on
    WORLD, so its characters beyond ASCII are two to four byte tokens, and a random model over it."""
    from tokenization import build_tokenizer

    tokenizer = build_tokenizer(WORLD * 4, kind="bpe", vocab_size=300, min_frequency=2)
    return random_model(tokenizer, WORLD), tokenizer


def release_file(name: str) -> Path:
    if not RELEASE or not (Path(RELEASE) / name).is_file():
        pytest.skip(f"set BRILLM05_RELEASE to the folder holding the released BriLLM0.5 files ({name})")
    return Path(RELEASE) / name


def release_english():
    """(model, tokenizer): the released English byte-level BPE tokenizer (4,000 tokens) and a random model over it."""
    from tokenization import load_released_tokenizer

    tokenizer = load_released_tokenizer(release_file("wiki_bpe_tokenizer_4000_bytelevel.json"))
    return random_model(tokenizer, WORLD), tokenizer


def release_chinese():
    """(model, tokenizer): the released Chinese character vocabulary (4,001 tokens) and a random model over it."""
    from tokenization import load_released_char_vocab

    tokenizer = load_released_char_vocab(release_file("vocab_wiki_4k.json"))
    return random_model(tokenizer, WORLD), tokenizer


def big_model(vocab_size: int = 4000, tokens: int = 2000, seed: int = 0):
    """(model, ids): an untrained sparse model of `vocab_size` nodes, d = 4, reading past its 64 positions, and a
    random path of `tokens` ids whose bigrams are its real edges half of the time."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (tokens,), generator=g)
    torch.manual_seed(seed)
    model = BriLLMForCausalLM.from_token_sequences(
        [ids[: tokens // 2]], vocab_size=vocab_size, node_size=4, min_count=1, max_position_embeddings=64,
        position_overflow="extend", bos_token_id=2, eos_token_id=3, pad_token_id=0)
    return model.eval(), ids


def successors(model, u: int) -> set[int]:
    """u's real successors, read from the graph the model stores."""
    indptr, indices = model.brillm.graph_indptr, model.brillm.graph_indices
    return set(indices[int(indptr[u]):int(indptr[u + 1])].tolist())
