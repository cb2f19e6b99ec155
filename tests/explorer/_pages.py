"""The explorer tests' models and texts: a tiny model whose vocabulary holds tokens a page must escape, and a tiny
random model of V = 4000 nodes for a 2,000-token page."""

from __future__ import annotations

import torch
from _tiny import make_model, make_tokenizer

from modeling_brillm import BriLLMForCausalLM

# tokens that would run code, break an attribute or hide characters if the page inserted them as markup
TRICKY = ["<script>window.pwned=1</script>", '<img src=x onerror="window.pwned=2">', "\"it's\"", "\u202eevil", "\t",
          "\x07", "\n"]
TEXT = "the cat " + TRICKY[0] + " sat " + TRICKY[2] + " on" + TRICKY[1] + " the\tmat" + TRICKY[3] + "\x07\n"


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
