"""pretrain.py's default step on a GPU: the batch it chooses with no batch flag (GPU_STEP_TOKENS, fitted to the
device's free memory) and the training tokens/s it reaches, beside gpu_throughput.py's for the shape.

    python benchmarks/gpu_default_batch.py                       # on a GPU: the paper's shape, 60 s of training
    python benchmarks/gpu_default_batch.py --vocab 64 --successors 8 --tokens 20000 --seconds 2   # a smoke test

The corpus is synthetic: lines of Zipf paths along a graph of `--vocab` nodes with `--successors` successors each, one
character per node (`--tokenizer_kind char`, `--min_bigram_count 1`, contiguous blocks of 32), so the graph approaches
the paper's as far as `--tokens` visit its edges. pretrain.py runs in this process for `--seconds` of training. The
record: the batch and its start-up line, the graph, tokens/s, the peak memory beside the estimate, and the training
rows of gpu_throughput's newest record in `--results_dir` (else the newest committed one).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, ZipfPaths, add_results_dir, synthetic_graph, write_record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

FIRST_CHAR = 0x4E00  # node k is the character U+4E00 + k (CJK ideographs: one character, one token)


def write_corpus(path: Path, vocab: int, successors: int, tokens: int, line: int = 256, seed: int = 0) -> None:
    """`tokens` characters in lines of `line`, walking the synthetic graph's edges."""
    paths = ZipfPaths(synthetic_graph(vocab, successors, seed), seed=seed + 1)
    rows = paths.batch(max(1, tokens // line), line)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows.tolist():
            handle.write("".join(chr(FIRST_CHAR + t) for t in row) + "\n")


class Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy (pretrain.py's start-up lines are read back)."""

    def __init__(self, stream):
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text):
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def throughput_rows(results_dir: Path) -> tuple[str | None, list]:
    """(the record, its training rows of the Triton path at the paper's shape) of gpu_throughput's newest record in
    `results_dir`, else in benchmarks/results. A run's record has `rows`; a transcribed one a `train` table."""
    for folder in (results_dir, RESULTS_DIR):
        records = sorted(Path(folder).glob("gpu_throughput-*.json"), key=lambda p: p.name)
        if records:
            break
    else:
        return None, []
    figures = json.loads(records[-1].read_text())["figures"]
    if "rows" in figures:
        rows = [dict(batch=f"{r['B']}x{r['L']}", tokens_per_s=r["tokens_per_s"], peak_gb=r["peak_gb"],
                     optimizer=r["optimizer"]) for r in figures["rows"]
                if r["kind"] == "train" and r["shape"] == "paper" and r["backend"] == "triton"
                and r["objective"] == "exact"]
    else:
        rows = [dict(batch=r["batch"].replace(" × ", "x"), tokens_per_s=r["triton_tokens_per_s"],
                     peak_gb=r["peak_gb"]) for r in figures.get("train", [])]
    try:
        name = str(records[-1].resolve().relative_to(ROOT))
    except ValueError:
        name = records[-1].name
    return name, rows


def pretrain_argv(args, corpus: Path, out: Path) -> list[str]:
    return ["--train_file", str(corpus), "--tokenizer_kind", "char", "--vocab_size", str(args.vocab + 4),
            "--min_bigram_count", "1", "--contiguous_blocks", "--block_size", "32", "--node_size", str(args.node_size),
            "--validation_split_percentage", "0", "--num_generations", "0", "--max_train_time", str(args.seconds),
            "--output_dir", str(out)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=4000, help="nodes of the synthetic graph (the paper: 4000)")
    parser.add_argument("--successors", type=int, default=227, help="successors per node (the paper: 227)")
    parser.add_argument("--node_size", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8_000_000, help="characters of the synthetic corpus")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time (pretrain.py --max_train_time)")
    args = add_results_dir(parser).parse_args(argv)
    from modeling_brillm.training import pretraining as pretrain  # what examples/pretrain.py runs
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        corpus, out = Path(tmp) / "corpus.txt", Path(tmp) / "run"
        write_corpus(corpus, args.vocab, args.successors, args.tokens)
        tee = Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            code = pretrain.main(pretrain_argv(args, corpus, out))
        if code != 0:
            raise SystemExit(f"pretrain.py exited with {code}")
        summary = json.loads((out / pretrain.SUMMARY_NAME).read_text())
        settings = {s["name"]: s for s in json.loads((out / "recipe.json").read_text())["settings"]}
    text = tee.kept.getvalue()
    batch = settings["per_device_train_batch_size"]
    estimate = re.search(r"needs ~([\d.]+ [KMGT]?B)|using \d+ \(~([\d.]+ [KMGT]?B)\)", batch["why"] or "")
    record_name, rows = throughput_rows(Path(args.results_dir))
    figures = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu",
        batch=batch["value"], block_size=32, rule=batch["rule"], startup_line=batch["why"],
        estimate=next((g for g in estimate.groups() if g), None) if estimate else None,
        peak_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        vocab_size=summary["vocab_size"], num_edges=summary["num_edges"], num_parameters=summary["num_parameters"],
        steps=summary["steps"], train_seconds=summary["train_seconds"], tokens_per_s=summary["tokens_per_second"],
        throughput_record=record_name, throughput_rows=rows,
        graph_line=next((line for line in text.splitlines() if line.startswith("graph: ")), None))
    best = max((r["tokens_per_s"] for r in rows), default=None)
    print(f"default batch {figures['batch']} x 32 [{figures['rule']}]: {figures['tokens_per_s']:,.0f} training "
          f"tokens/s over {figures['train_seconds']} s ({figures['num_parameters']:,} parameters); peak "
          f"{figures['peak_gb'] or 0:.1f} GB, estimate {figures['estimate']}; gpu_throughput's best at the paper "
          f"shape: {best and f'{best:,.0f}'} tokens/s ({record_name})")
    write_record("gpu_default_batch", args, figures, argv=argv)
    return figures


if __name__ == "__main__":
    main()
