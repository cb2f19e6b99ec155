"""Build and load BriLLM tokenizers with the Hugging Face ``tokenizers`` library.

BriLLM gives every vocabulary entry its own graph node, so the vocabulary is
small (the paper uses about 4000 tokens) and two styles are needed:

* ``kind="bpe"`` -- byte-level BPE for English, like the released BriLLM0.5
  English tokenizer: NFKC normaliser, ByteLevel pre-tokenizer/decoder and a
  BPE model trained with the full 256-symbol byte alphabet, so *any* text
  encodes without ``<unk>``.
* ``kind="char"`` -- one token per character for Chinese: the most frequent
  characters of the corpus plus ``<unk>``.

Special tokens of the tokenizers built here (ids fixed, in this order)::

    0 <pad>   1 <unk>   2 <s> (bos)   3 </s> (eos)

With ``add_special_tokens=True`` (the ``transformers`` default) the
post-processor prepends ``<s>`` to every sequence; ``</s>`` is never appended
automatically (add it yourself where a sequence must end).

The released BriLLM0.5 files use other conventions and are loaded as they are,
with unchanged ids: :func:`load_released_tokenizer` (English BPE JSON,
``[PAD] [UNK] [CLS] [SEP] [MASK]`` = 0..4) and :func:`load_released_char_vocab`
(Chinese ``character -> id`` JSON, only ``<unk>`` special).

Command line::

    python -m tokenization.build_tokenizer --kind bpe --vocab_size 4000 \\
        --output_dir out/tok --train_file corpus.txt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "SPECIAL_TOKENS",
    "PAD_TOKEN",
    "UNK_TOKEN",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "BYTE_ALPHABET_SIZE",
    "KINDS",
    "build_tokenizer",
    "load_released_tokenizer",
    "load_released_char_vocab",
    "main",
]

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# Order matters: trainers assign ids in list order, giving pad=0 unk=1 bos=2 eos=3.
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]
BYTE_ALPHABET_SIZE = 256
KINDS = ("bpe", "char")

# Released BriLLM0.5 English tokenizer specials (ids 0..4 in its JSON).
_RELEASED_SPECIALS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "bos_token": "[CLS]",
    "eos_token": "[SEP]",
    "mask_token": "[MASK]",
}

# Extensions treated as text files when they appear in a list of strings; used
# only to turn a typo'd path into a FileNotFoundError instead of silently
# training on the path string itself.
_TEXT_FILE_SUFFIXES = (".txt", ".text")

_BATCH_SIZE = 1000


# --------------------------------------------------------------------------- #
# Input handling
# --------------------------------------------------------------------------- #
def _is_dataset(obj: Any) -> bool:
    """True for ``datasets.Dataset``/``IterableDataset`` (duck-typed so that
    importing this module does not import ``datasets``)."""
    return hasattr(obj, "column_names") and (hasattr(obj, "iter") or hasattr(obj, "__iter__"))


def _looks_like_path(item: Any) -> bool:
    """A str that is plausibly a file name rather than a document."""
    return isinstance(item, str) and "\n" not in item and item.lower().endswith(_TEXT_FILE_SUFFIXES)


def _iter_file(path: Path) -> Iterator[str]:
    """Yield one document per line (line ending removed) of a UTF-8 file.

    Lines are streamed so corpora larger than memory work; the newline that
    separates documents is not part of any document. A file that is not
    UTF-8 raises ValueError naming the line and byte of the first bad byte.
    """
    with open(path, encoding="utf-8") as handle:
        try:
            for line in handle:
                yield line.rstrip("\r\n")
        except UnicodeDecodeError:
            from .text_files import utf8_problem  # the file is scanned only when it fails

            raise ValueError(utf8_problem(path)) from None


def _iter_dataset(dataset: Any, text_column: str) -> Iterator[str]:
    """Return an iterator over the ``text_column`` of a ``datasets`` dataset.

    The column is checked here, before training starts (not lazily inside the
    trainer), and rows are read in batches.
    """
    columns = dataset.column_names
    if columns is not None and text_column not in columns:
        raise ValueError(
            f"text_column={text_column!r} is not a column of the dataset (columns: {list(columns)}); "
            "pass text_column=<name of the text column>."
        )

    def generate() -> Iterator[str]:
        if hasattr(dataset, "iter"):
            # Batched access is much faster than row-by-row for Arrow-backed datasets.
            for batch in dataset.iter(batch_size=_BATCH_SIZE):
                yield from batch[text_column]
        else:
            for row in dataset:
                yield row[text_column]

    return generate()


def _resolve_input(data: Any, text_column: str) -> Iterator[str]:
    """Turn any supported input into a (lazy) iterator of raw texts.

    Supported inputs:

    * a ``datasets.Dataset`` / ``IterableDataset`` -> its ``text_column``;
    * one path (``str``/``os.PathLike``; a lone ``str`` is never read as
      text) or a list/tuple of paths -> the lines of each file (see
      :func:`_iter_file`);
    * a list/tuple/iterator of strings -> each string is one document.

    A list is read as file paths when every item is an ``os.PathLike`` or an
    existing file; an item that looks like a ``*.txt`` path but does not exist
    raises ``FileNotFoundError`` (rather than being trained on as text).
    """
    if data is None:
        raise ValueError("No training input: pass texts, text file paths or a datasets.Dataset.")
    if _is_dataset(data):
        return _iter_dataset(data, text_column)
    if isinstance(data, (str, os.PathLike)):
        # A lone string is always a path (raw text must be wrapped in a list),
        # so a mistyped file name fails instead of becoming the corpus.
        return _iter_files([Path(data)])
    if isinstance(data, (list, tuple)):
        if not data:
            raise ValueError("Empty training input: the list of texts/files is empty.")
        if all(isinstance(item, os.PathLike) or (isinstance(item, str) and os.path.isfile(item)) for item in data):
            return _iter_files([Path(item) for item in data])
        for item in data:
            if isinstance(item, os.PathLike) or _looks_like_path(item):
                if os.path.isfile(item):
                    raise ValueError("The input mixes file paths and raw texts; pass only paths or only texts.")
                raise FileNotFoundError(f"Training file not found: {os.fspath(item)!r}")
        return iter(data)
    if isinstance(data, Iterable):
        return iter(data)
    raise TypeError(
        f"Unsupported training input of type {type(data).__name__}: pass a list/iterator of strings, "
        "a list of text file paths or a datasets.Dataset."
    )


def _iter_files(paths: list[Path]) -> Iterator[str]:
    """Check that every file exists (eagerly, before training), then return
    an iterator over the documents of all files in order."""
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"Training file not found: {str(path)!r}")
    return (doc for path in paths for doc in _iter_file(path))


class _CountingTexts:
    """Iterator wrapper that validates items and counts non-empty documents.

    Inputs may be one-shot iterators, so emptiness can only be detected while
    the trainer consumes them; the count is checked after training.
    """

    def __init__(self, texts: Iterator[str]):
        self._texts = texts
        self.n_docs = 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            if text is None:  # missing values in datasets
                continue
            if not isinstance(text, str):
                raise TypeError(f"Training texts must be str, got {type(text).__name__}: {text!r:.80}")
            if text:
                self.n_docs += 1
                yield text


# --------------------------------------------------------------------------- #
# Tokenizer construction
# --------------------------------------------------------------------------- #
def _char_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # Isolate every code point, whitespace included ([\s\S] also matches "\n",
    # which "." would not), so a space is a token like any other character
    # instead of being dropped as a word separator.
    return pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")


def _bos_post_processor(bos_id: int) -> processors.TemplateProcessing:
    # Same template transformers itself builds for add_bos_token=True and
    # add_eos_token=False; eos is left to the caller (e.g. end of a document).
    return processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )


def _new_bpe(vocab_size: int, min_frequency: int) -> tuple[Tokenizer, trainers.Trainer]:
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # includes the special tokens
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols are always in the vocab, so no input maps to <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tokenizer, trainer


def _new_char(vocab_size: int, min_frequency: int) -> tuple[Tokenizer, trainers.Trainer]:
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    # No normaliser: characters (incl. full-width punctuation and U+00A0) must
    # round-trip exactly; NFKC would rewrite them.
    tokenizer.pre_tokenizer = _char_pre_tokenizer()
    # Fuse concatenates tokens; the default decoder would insert spaces.
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size,  # includes the special tokens
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    return tokenizer, trainer


def _check_vocab_size(kind: str, vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    n_special = len(SPECIAL_TOKENS)
    if kind == "bpe":
        minimum = n_special + BYTE_ALPHABET_SIZE
        if vocab_size < minimum:
            raise ValueError(
                f"vocab_size={vocab_size} is too small for kind='bpe': it needs the {n_special} special tokens "
                f"plus the {BYTE_ALPHABET_SIZE}-symbol byte alphabet; use vocab_size >= {minimum} "
                "(BriLLM0.5 uses 4000)."
            )
    elif vocab_size <= n_special:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for kind='char': it counts the {n_special} special tokens, "
            f"so use vocab_size >= {n_special + 1} to keep at least one character."
        )


def build_tokenizer(
    texts_or_files_or_dataset: Any,
    kind: str = "bpe",
    vocab_size: int = 4000,
    output_dir: str | os.PathLike | None = None,
    text_column: str = "text",
    min_frequency: int = 2,
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a BriLLM tokenizer and wrap it as a ``PreTrainedTokenizerFast``.

    ``texts_or_files_or_dataset``: a list or iterator of strings (one document each), a text file's path or a list
    of them (a document a line), or a ``datasets.Dataset`` (its ``text_column``); empty texts are skipped. ``kind``:
    ``"bpe"`` (byte-level BPE, English; text NFKC-normalised first) or ``"char"`` (a token a character, whitespace
    included; Chinese). ``vocab_size`` counts the 4 special tokens (bpe needs at least 4 + 256); ``min_frequency``:
    a merge or character enters the vocabulary at this count. ``output_dir``: ``save_pretrained`` there (loads with
    ``AutoTokenizer`` and no custom code). ``model_max_length``: None means no limit (texts are split into blocks
    by the callers); a tokenizer saved beside a model records ``config.max_position_embeddings``.

    Returns the tokenizer, with ``<pad> <unk> <s> </s>`` at ids 0..3 and ``<s>`` prepended by the post-processor in
    ``tokenizer.json`` (do not toggle ``add_bos_token``: transformers would rebuild the template). A ValueError names
    an unknown ``kind``, a too small ``vocab_size``, an empty corpus or a missing ``text_column``.
    """
    if kind not in KINDS:
        raise ValueError(f"Unknown tokenizer kind {kind!r}; use one of {list(KINDS)} ('bpe' for English, "
                         "'char' for Chinese).")
    _check_vocab_size(kind, vocab_size)
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")

    texts = _CountingTexts(_resolve_input(texts_or_files_or_dataset, text_column))
    tokenizer, trainer = (_new_bpe if kind == "bpe" else _new_char)(vocab_size, min_frequency)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if texts.n_docs == 0:
        raise ValueError(
            "Empty corpus: the training input contains no text (all documents/lines are empty); "
            "pass non-empty texts, files or a dataset with a non-empty text column."
        )

    for expected_id, token in enumerate(SPECIAL_TOKENS):
        # Guards the documented id scheme against trainer behaviour changes.
        actual = tokenizer.token_to_id(token)
        if actual != expected_id:
            raise RuntimeError(f"special token {token!r} got id {actual}, expected {expected_id}")
    tokenizer.post_processor = _bos_post_processor(tokenizer.token_to_id(BOS_TOKEN))

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        # add_bos_token is deliberately not passed: transformers v5 does not save
        # it when a tokenizer.json exists, so the TemplateProcessing stored in
        # tokenizer.json is the single source of truth (same before and after reload).
        model_max_length=model_max_length,
        # The default clean-up removes spaces before punctuation, which breaks
        # decode(encode(x)) == x for both kinds.
        clean_up_tokenization_spaces=False,
    )
    if output_dir is not None:
        wrapped.save_pretrained(os.fspath(output_dir))
    return wrapped


# --------------------------------------------------------------------------- #
# Released BriLLM0.5 tokenizers
# --------------------------------------------------------------------------- #
def load_released_tokenizer(
    path_to_tokenizer_json: str | os.PathLike, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """Load the released BriLLM0.5 English tokenizer JSON unchanged.

    The file is a ``tokenizers`` JSON (NFKC, byte-level BPE with
    ``add_prefix_space=True``, 4000 tokens) whose specials ``[PAD] [UNK] [CLS]
    [SEP] [MASK]`` have ids 0..4.  They are mapped to pad/unk/bos/eos/mask;
    no id is changed.  The release has no post-processor, so encoding adds no
    special tokens (ids equal ``tokenizers.Tokenizer.from_file(path).encode``).

    Args:
        path_to_tokenizer_json: path to ``wiki_bpe_tokenizer_4000_bytelevel.json``.
        model_max_length: stored on the tokenizer; None (default) means no limit, as in ``build_tokenizer``.
    """
    path = Path(path_to_tokenizer_json)
    if not path.is_file():
        raise FileNotFoundError(f"Released tokenizer JSON not found: {str(path)!r}")
    backend = Tokenizer.from_file(os.fspath(path))
    missing = [tok for tok in _RELEASED_SPECIALS.values() if backend.token_to_id(tok) is None]
    if missing:
        raise ValueError(f"{str(path)!r} is not the BriLLM0.5 tokenizer: special tokens {missing} are missing.")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        **_RELEASED_SPECIALS,
    )


def load_released_char_vocab(
    path_to_vocab_json: str | os.PathLike, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """Build a char-level tokenizer from the released Chinese BriLLM0.5 vocab.

    The file (``vocab_wiki_4k.json``) maps each character to its id (4001
    entries, ``"<unk>" = 0``).  The tokenizer uses exactly those ids: every
    character is one token, unknown characters map to ``<unk>``, decoding
    concatenates characters, no normalisation is applied.

    The release defines no pad/bos/eos tokens, so ``pad_token``,
    ``bos_token`` and ``eos_token`` are left ``None`` (nothing is added,
    which would change the vocabulary size of a converted checkpoint) and
    encoding adds no special tokens.  Set ``tokenizer.pad_token`` yourself
    (e.g. to ``"<unk>"``) if you need batch padding.

    Args:
        path_to_vocab_json: path to the ``character -> id`` JSON.
        model_max_length: stored on the tokenizer; None (default) means no limit, as in ``build_tokenizer``.
    """
    path = Path(path_to_vocab_json)
    if not path.is_file():
        raise FileNotFoundError(f"Released vocab JSON not found: {str(path)!r}")
    with open(path, encoding="utf-8") as handle:
        vocab = json.load(handle)
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"{str(path)!r} must be a JSON object mapping token -> integer id.")
    if UNK_TOKEN not in vocab:
        raise ValueError(f"{str(path)!r} has no {UNK_TOKEN!r} entry.")
    if sorted(vocab.values()) != list(range(len(vocab))):
        # Gaps or duplicates would make the model's node ids ambiguous.
        raise ValueError(f"{str(path)!r}: ids must be unique and cover 0..{len(vocab) - 1}.")

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = _char_pre_tokenizer()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tokenization.build_tokenizer",
        description=(
            "Train a BriLLM tokenizer (byte-level BPE for English or character-level for Chinese) "
            "and save it with save_pretrained. Special tokens: <pad>=0 <unk>=1 <s>=2 </s>=3; "
            "<s> is prepended to every encoded sequence."
        ),
    )
    parser.add_argument("--kind", choices=KINDS, default="bpe",
                        help="bpe (byte-level BPE) or char (one token per character).")
    parser.add_argument("--vocab_size", type=int, default=4000,
                        help="Total vocab size incl. the 4 special tokens (bpe: >= 260).")
    parser.add_argument("--output_dir", required=True, help="Folder to write the tokenizer to (created if needed).")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--train_file", nargs="+", help="One or more UTF-8 text files, one document per line.")
    source.add_argument("--dataset_name", help="A datasets Hub name or local dataset folder (see --dataset_split).")
    parser.add_argument("--dataset_config_name", default=None, help="Dataset configuration name.")
    parser.add_argument("--dataset_split", default="train", help="Dataset split to train on (default: train).")
    parser.add_argument("--text_column", default="text", help="Dataset column holding the text (default: text).")
    parser.add_argument("--min_frequency", type=int, default=2, help="Minimum count of a merge/character (default: 2).")
    parser.add_argument("--model_max_length", type=int, default=None,
                        help="Stored max sequence length: the model's max_position_embeddings when the tokenizer "
                             "goes beside a model (default: none, so long texts tokenize without warnings).")
    args = parser.parse_args(argv)

    if args.train_file is None and args.dataset_name is None:
        parser.error("no training input: pass --train_file FILE [FILE ...] or --dataset_name NAME.")
    if args.train_file is not None:
        missing = [f for f in args.train_file if not os.path.isfile(f)]
        if missing:
            parser.error(f"--train_file not found: {', '.join(missing)}")
    try:
        _check_vocab_size(args.kind, args.vocab_size)
    except ValueError as err:
        parser.error(str(err))
    if args.min_frequency < 1:
        parser.error("--min_frequency must be >= 1.")
    return args


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    args = _parse_args(argv)
    if args.train_file is not None:
        data: Any = list(args.train_file)
    else:
        import datasets  # imported lazily: only the --dataset_name path needs it

        data = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split=args.dataset_split)
    try:
        tokenizer = build_tokenizer(
            data,
            kind=args.kind,
            vocab_size=args.vocab_size,
            output_dir=args.output_dir,
            text_column=args.text_column,
            min_frequency=args.min_frequency,
            model_max_length=args.model_max_length,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"Saved {args.kind} tokenizer with {len(tokenizer)} tokens to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
