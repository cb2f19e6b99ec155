"""BriLLM tokenizers: train byte-level BPE / character tokenizers and load the BriLLM0.5 releases.

See :mod:`tokenization.build_tokenizer` for the special-token scheme
(``<pad>=0 <unk>=1 <s>=2 </s>=3``, ``<s>`` prepended to every sequence).
"""

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

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "build_tokenizer",
    "load_released_char_vocab",
    "load_released_tokenizer",
]
