"""BriLLM tokenizers: train byte-level BPE / character tokenizers and load the BriLLM0.5 releases.

See :mod:`tokenization.build_tokenizer` for the special-token scheme
(``<pad>=0 <unk>=1 <s>=2 </s>=3``, ``<s>`` prepended to every sequence).
"""

import sys

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

# While `python -m tokenization.build_tokenizer` locates its module, sys.argv[0]
# is "-m".  Importing the submodule here in that case would make runpy execute
# it twice and warn ("found in sys.modules ... unpredictable behaviour"), so the
# re-export is skipped for that one CLI process, which does not need it.
# Otherwise the import is eager, so `tokenization.build_tokenizer` is always the
# function, never the same-named submodule.
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
