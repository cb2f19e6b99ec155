"""BriLLM tokenizers, byte-level BPE or characters, and the BriLLM0.5 releases (:mod:`tokenization.build_tokenizer`)."""

import sys

__all__ = ["BOS_TOKEN", "EOS_TOKEN", "PAD_TOKEN", "SPECIAL_TOKENS", "UNK_TOKEN", "build_tokenizer",
           "load_released_char_vocab", "load_released_tokenizer"]

# Under `python -m tokenization.build_tokenizer` (sys.argv[0] is "-m" while runpy finds the module) importing it here
# would make runpy run it twice and warn; elsewhere it is eager, so `tokenization.build_tokenizer` is the function.
if getattr(sys, "argv", [None])[:1] != ["-m"]:
    from .build_tokenizer import (
        BOS_TOKEN,
        EOS_TOKEN,
        PAD_TOKEN,
        SPECIAL_TOKENS,
        UNK_TOKEN,
        build_tokenizer,
        load_released_char_vocab,
        load_released_tokenizer,
    )
