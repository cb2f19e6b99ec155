"""Build and load BriLLM tokenizers with the Hugging Face ``tokenizers`` library.

Every vocabulary entry is a graph node, so the vocabulary is small (the paper: about 4000 tokens). ``kind="bpe"``:
byte-level BPE for English like the released BriLLM0.5 tokenizer (NFKC, the full 256-symbol byte alphabet: any text
encodes without ``<unk>``); ``kind="char"``: one token per character for Chinese (the most frequent ones and
``<unk>``). Their special tokens have fixed ids, ``0 <pad>  1 <unk>  2 <s> (bos)  3 </s> (eos)``; ``<s>`` is
prepended to every sequence, ``</s>`` never appended. The released BriLLM0.5 files keep their own ids:
:func:`load_released_tokenizer` and :func:`load_released_char_vocab`.

    python -m tokenization.build_tokenizer --kind bpe --vocab_size 4000 --output_dir out/tok --train_file corpus.txt
"""

import argparse
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]  # trainers assign ids in this order: 0..3
BYTE_ALPHABET_SIZE = 256
KINDS = ("bpe", "char")
_RELEASED_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "bos_token": "[CLS]", "eos_token": "[SEP]",
                      "mask_token": "[MASK]"}  # ids 0..4 in the released English JSON


def _iter_files(paths: list[Path]) -> Iterator[str]:
    """The files' documents, a line each, streamed; every file checked to exist first, bad UTF-8 named by its byte."""
    if missing := [path for path in paths if not path.is_file()]:
        raise FileNotFoundError(f"Training file not found: {str(missing[0])!r}")
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            try:
                yield from (line.rstrip("\r\n") for line in handle)
            except UnicodeDecodeError:
                from .text_files import utf8_problem  # the file is scanned only when it fails

                raise ValueError(utf8_problem(path)) from None


def _iter_dataset(dataset: Any, text_column: str) -> Iterator[str]:
    """The ``text_column`` of a dataset, read in batches; the column checked now, not inside the trainer."""
    if (columns := dataset.column_names) is not None and text_column not in columns:
        raise ValueError(f"text_column={text_column!r} is not a column of the dataset (columns: {list(columns)}); "
                         "pass text_column=<name of the text column>.")
    if hasattr(dataset, "iter"):  # batches: much faster than rows for Arrow-backed datasets
        return (text for batch in dataset.iter(batch_size=1000) for text in batch[text_column])
    return (row[text_column] for row in dataset)


def _resolve_input(data: Any, text_column: str) -> Iterator[str]:
    """The raw texts of any supported input (see `build_tokenizer`). A lone str is always a path, a list is read as
    paths when every item is an ``os.PathLike`` or an existing file, and an item named like a text file (.txt, .text)
    that is none fails, so a mistyped file name never becomes the corpus."""
    if data is None:
        raise ValueError("No training input: pass texts, text file paths or a datasets.Dataset.")
    if hasattr(data, "column_names") and (hasattr(data, "iter") or hasattr(data, "__iter__")):  # a Dataset, duck-typed
        return _iter_dataset(data, text_column)
    if isinstance(data, (str, os.PathLike)):
        return _iter_files([Path(data)])
    if isinstance(data, (list, tuple)):
        if all(isinstance(item, os.PathLike) or (isinstance(item, str) and os.path.isfile(item)) for item in data):
            return _iter_files([Path(item) for item in data])
        named = [item for item in data if isinstance(item, os.PathLike) or (
            isinstance(item, str) and "\n" not in item and item.lower().endswith((".txt", ".text")))]
        if named and os.path.isfile(named[0]):
            raise ValueError("The input mixes file paths and raw texts; pass only paths or only texts.")
        if named:
            raise FileNotFoundError(f"Training file not found: {os.fspath(named[0])!r}")
    if isinstance(data, Iterable):  # a list of texts too
        return iter(data)
    raise TypeError(f"Unsupported training input of type {type(data).__name__}: pass a list/iterator of strings, "
                    "a list of text file paths or a datasets.Dataset.")


def _documents(texts: Iterator[str]) -> Iterator[str]:
    """The non-empty texts, each checked to be a str (None, a dataset's missing value, skipped)."""
    for text in texts:
        if text is not None and not isinstance(text, str):
            raise TypeError(f"Training texts must be str, got {type(text).__name__}: {text!r:.80}")
        if text:
            yield text


def _char_backend(model) -> Tokenizer:
    """Every code point its own token, whitespace included (``[\\s\\S]`` also matches "\\n"); no normaliser, so
    full-width punctuation and U+00A0 round-trip (NFKC would rewrite them); Fuse decodes without added spaces."""
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def _new_tokenizer(kind: str, vocab_size: int, min_frequency: int) -> tuple[Tokenizer, trainers.Trainer]:
    options = {"vocab_size": vocab_size, "min_frequency": min_frequency, "special_tokens": SPECIAL_TOKENS,
               "show_progress": False}  # vocab_size counts the special tokens
    if kind == "char":
        return _char_backend(models.WordLevel(unk_token=UNK_TOKEN)), trainers.WordLevelTrainer(**options)
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # all 256 byte symbols always in the vocabulary, so no input maps to <unk>
    return tokenizer, trainers.BpeTrainer(initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), **options)


def _wrap(backend: Tokenizer, model_max_length: int | None, **specials) -> PreTrainedTokenizerFast:
    # the default clean-up removes spaces before punctuation, which breaks decode(encode(x)) == x
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)


def _check_sizes(kind: str, vocab_size: int, min_frequency: int) -> None:
    """The vocabulary size and minimum count checked against `kind`, before any text is read."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    n = len(SPECIAL_TOKENS)
    if kind == "bpe" and vocab_size < n + BYTE_ALPHABET_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small for kind='bpe': it needs the {n} special tokens plus "
                         f"the {BYTE_ALPHABET_SIZE}-symbol byte alphabet; use vocab_size >= {n + BYTE_ALPHABET_SIZE} "
                         "(BriLLM0.5 uses 4000).")
    if kind != "bpe" and vocab_size <= n:
        raise ValueError(f"vocab_size={vocab_size} is too small for kind='char': it counts the {n} special tokens, "
                         f"so use vocab_size >= {n + 1} to keep at least one character.")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")


def build_tokenizer(texts_or_files_or_dataset: Any, kind: str = "bpe", vocab_size: int = 4000,
                    output_dir: str | os.PathLike | None = None, text_column: str = "text", min_frequency: int = 2,
                    model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Train a BriLLM tokenizer (the module's docstring) and wrap it as a ``PreTrainedTokenizerFast``.

    `texts_or_files_or_dataset`: strings (one document each), one text-file path or a list of them (a document a
    line; a lone str is always a path), or a ``datasets.Dataset``/``IterableDataset`` (its `text_column`, read in
    batches); empty strings and ``None`` are skipped. `vocab_size` counts the 4 special tokens (a small corpus may
    give fewer); `min_frequency`: the least count of a merge / a character; `model_max_length` (None: no limit) is
    the model's ``max_position_embeddings`` for one saved beside a model (docs/integrations.md).

    ``<s>`` is prepended by the post-processor saved in ``tokenizer.json`` (``add_bos_token`` reads ``False``: do not
    set ``add_bos_token``/``add_eos_token``, which makes transformers rebuild the template). BPE round-trips
    NFKC-normalised text ("\ufb01" comes back as "fi"); char keeps a whitespace character (tab, U+00A0, ...) only
    when frequent enough (else ``<unk>``), and "\\n" only from texts passed in (a file is read a document a line).
    """
    if kind not in KINDS:
        raise ValueError(f"Unknown tokenizer kind {kind!r}; use one of {list(KINDS)} ('bpe' for English, "
                         "'char' for Chinese).")
    _check_sizes(kind, vocab_size, min_frequency)
    texts = _documents(_resolve_input(texts_or_files_or_dataset, text_column))
    if (first := next(texts, None)) is None:  # a one-shot iterator shows it is empty only once read
        raise ValueError("Empty corpus: the training input contains no text (all documents/lines are empty); "
                         "pass non-empty texts, files or a dataset with a non-empty text column.")
    tokenizer, trainer = _new_tokenizer(kind, vocab_size, min_frequency)
    tokenizer.train_from_iterator(itertools.chain([first], texts), trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):  # the documented ids, whatever a trainer version does
        if (actual := tokenizer.token_to_id(token)) != expected_id:
            raise RuntimeError(f"special token {token!r} got id {actual}, expected {expected_id}")
    # the template transformers builds for add_bos_token=True, add_eos_token=False; saved in tokenizer.json, the one
    # source of truth (transformers does not save add_bos_token beside a tokenizer.json)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0", pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))])
    wrapped = _wrap(tokenizer, model_max_length, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN, bos_token=BOS_TOKEN,
                    eos_token=EOS_TOKEN)
    if output_dir is not None:
        wrapped.save_pretrained(os.fspath(output_dir))
    return wrapped


def _released_file(path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Released {what} JSON not found: {str(path)!r}")
    return path


def load_released_tokenizer(path_to_tokenizer_json: str | os.PathLike,
                            model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """The released BriLLM0.5 English tokenizer (``wiki_bpe_tokenizer_4000_bytelevel.json``: NFKC, byte-level BPE
    with ``add_prefix_space=True``, 4000 tokens) unchanged: ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0..4) as
    pad/unk/bos/eos/mask, and no special tokens added when encoding (the release has no post-processor)."""
    path = _released_file(path_to_tokenizer_json, "tokenizer")
    backend = Tokenizer.from_file(os.fspath(path))
    if missing := [tok for tok in _RELEASED_SPECIALS.values() if backend.token_to_id(tok) is None]:
        raise ValueError(f"{str(path)!r} is not the BriLLM0.5 tokenizer: special tokens {missing} are missing.")
    return _wrap(backend, model_max_length, **_RELEASED_SPECIALS)


def load_released_char_vocab(path_to_vocab_json: str | os.PathLike,
                             model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """A char-level tokenizer with exactly the ids of the released Chinese vocabulary (``vocab_wiki_4k.json``: 4001
    ``character -> id`` entries, ``"<unk>" = 0``): one token a character, unknown ones ``<unk>``, no normalisation.
    The release has no pad/bos/eos, so they stay ``None`` (adding them would change a converted checkpoint's
    vocabulary) and encoding adds no special tokens; set ``tokenizer.pad_token`` (e.g. ``"<unk>"``) to pad batches."""
    path = _released_file(path_to_vocab_json, "vocab")
    vocab = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"{str(path)!r} must be a JSON object mapping token -> integer id.")
    if UNK_TOKEN not in vocab:
        raise ValueError(f"{str(path)!r} has no {UNK_TOKEN!r} entry.")
    if sorted(vocab.values()) != list(range(len(vocab))):  # gaps or duplicates: ambiguous node ids
        raise ValueError(f"{str(path)!r}: ids must be unique and cover 0..{len(vocab) - 1}.")
    return _wrap(_char_backend(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN)), model_max_length,
                 unk_token=UNK_TOKEN)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2 after one ``error:`` line)."""
    parser = argparse.ArgumentParser(
        prog="python -m tokenization.build_tokenizer",
        description="Train a BriLLM tokenizer (byte-level BPE for English or character-level for Chinese) and save it "
                    "with save_pretrained. Special tokens: <pad>=0 <unk>=1 <s>=2 </s>=3; <s> is prepended to every "
                    "encoded sequence.")
    add = parser.add_argument
    add("--kind", choices=KINDS, default="bpe", help="bpe (byte-level BPE) or char (one token per character).")
    add("--vocab_size", type=int, default=4000, help="Total vocab size incl. the 4 special tokens (bpe: >= 260).")
    add("--output_dir", required=True, help="Folder to write the tokenizer to (created if needed).")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--train_file", nargs="+", help="One or more UTF-8 text files, one document per line.")
    source.add_argument("--dataset_name", help="A datasets Hub name or local dataset folder (see --dataset_split).")
    add("--dataset_config_name", default=None, help="Dataset configuration name.")
    add("--dataset_split", default="train", help="Dataset split to train on (default: train).")
    add("--text_column", default="text", help="Dataset column holding the text (default: text).")
    add("--min_frequency", type=int, default=2, help="Minimum count of a merge/character (default: 2).")
    add("--model_max_length", type=int, help="Stored max sequence length: the model's max_position_embeddings "
        "when the tokenizer goes beside a model (default: none, so long texts tokenize without warnings).")
    args = parser.parse_args(argv)
    # the mistakes found before a dataset is downloaded or a file read
    if args.train_file is None and args.dataset_name is None:
        parser.error("no training input: pass --train_file FILE [FILE ...] or --dataset_name NAME.")
    if missing := [f for f in args.train_file or [] if not os.path.isfile(f)]:
        parser.error(f"--train_file not found: {', '.join(missing)}")
    try:
        _check_sizes(args.kind, args.vocab_size, args.min_frequency)
    except ValueError as err:
        parser.error(str(err))
    data: Any = args.train_file
    if data is None:
        import datasets  # only --dataset_name needs it

        data = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split=args.dataset_split)
    try:
        tokenizer = build_tokenizer(data, kind=args.kind, vocab_size=args.vocab_size, output_dir=args.output_dir,
                                    text_column=args.text_column, min_frequency=args.min_frequency,
                                    model_max_length=args.model_max_length)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"Saved {args.kind} tokenizer with {len(tokenizer)} tokens to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
