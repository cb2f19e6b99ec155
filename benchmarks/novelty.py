"""Novelty: what the probe's data count c0 does to the novelty ν that decides whether text strays (docs/training.md's
rule table: NOVEL, RECURRENCE). For each corpus, the probe of pretrain.py's training blocks (the same tokenizer and
blocks a run makes): c0, ν at c0, and ν had the count been 1, 2, 3 or 4 (the share of the held-out runs' bigram
occurrences whose bigram the other runs saw fewer times); the record holds them as fractions and as percentages.

    python benchmarks/novelty.py --corpus outputs/corpora/small outputs/corpora/literature --vocab_size 2000 \\
        --block_size 64
    python benchmarks/novelty.py --demo

A corpus is a folder with train.jsonl and validation.jsonl (benchmarks/corpora.py builds them); `--demo` adds the
demo's embedded manual with `make demo`'s flags. Only the data is prepared: nothing trains. Writes the record
(benchmarks/results). Exit status 2 with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quality  # noqa: E402  (pretrain.py's data preparation, shared with the quality rows)
from common import add_results_dir, write_record  # noqa: E402

DEMO = ["--config", "demo", "--vocab_size", "512", "--block_size", "32"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", nargs="*", default=[], help="Folders holding train.jsonl and validation.jsonl.")
    p.add_argument("--demo", action="store_true", help="Also the demo's embedded manual (make demo's flags).")
    p.add_argument("--vocab_size", type=int, default=2000, help="BPE vocabulary trained on each corpus.")
    p.add_argument("--block_size", type=int, default=64, help="Tokens per block.")
    p.add_argument("--output_dir", default="outputs/novelty", help="Where the tokenizers go.")
    return add_results_dir(p).parse_args(argv)


def corpus_argv(args, folder: Path) -> list[str]:
    for split in ("train", "validation"):
        if not (folder / f"{split}.jsonl").is_file():
            raise quality.UsageError(f"{folder} has no {split}.jsonl: give folders that benchmarks/corpora.py built.")
    return ["--train_file", str(folder / "train.jsonl"), "--validation_file", str(folder / "validation.jsonl"),
            "--vocab_size", str(args.vocab_size), "--block_size", str(args.block_size)]


def probe_row(name: str, argv: list[str], output_dir: Path) -> dict:
    """The probe of pretrain.py's training blocks for these data flags."""
    from modeling_brillm.training.data import block_sequences
    from modeling_brillm.training.pruning import probe_bigrams

    data, _, _ = quality.shared_data([*argv, "--output_dir", str(output_dir / name)])
    sequences = list(block_sequences(data.train, data.tokenizer.pad_token_id))
    held = probe_bigrams(sequences, len(data.tokenizer)).held_out
    return dict(corpus=name, tokens=int(sum(len(s) for s in sequences)), c0=held.data_count, novelty=held.novelty,
                novelty_at={str(c): v for c, v in held.novelty_at.items()},
                percent={"c0": 100 * held.novelty, **{str(c): 100 * v for c, v in held.novelty_at.items()}})


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        jobs = [(Path(c).name, corpus_argv(args, Path(c))) for c in args.corpus] + [("demo", DEMO)] * args.demo
        if not jobs:
            raise quality.UsageError("nothing to probe: give --corpus FOLDER... or --demo.")
        rows = [probe_row(name, job, Path(args.output_dir)) for name, job in jobs]
    except quality.UsageError as error:
        print(f"novelty.py: {error}", file=sys.stderr)
        return 2
    print("| corpus | tokens | c0 | ν at c0 | at 1 | at 2 | at 3 | at 4 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        at = r["novelty_at"]
        print(f"| {r['corpus']} | {r['tokens']:,} | {r['c0']} | {r['novelty']:.1%} | "
              + " | ".join(f"{at[str(c)]:.1%}" for c in range(1, 5)) + " |")
    write_record("novelty", args, {"rows": rows}, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
