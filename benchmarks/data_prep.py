"""Data preparation speed: training the tokenizer, cutting blocks and building the graph, in MB of text per second.

    python benchmarks/data_prep.py                          # 20 MB of text, every stage
    python benchmarks/data_prep.py --size_mb 5 --num_proc 2 --stages tokenization graph
    BRILLM_ROOT=/path/to/other/checkout python benchmarks/data_prep.py   # the same on another copy of the code

The text: Python's documentation (the built-in corpus, ten paragraphs a document), then the standard library's own
source files, cycled to `--size_mb`, read as pretraining reads `--train_file` (into a fresh datasets cache). Each stage
is timed once as `examples/pretrain.py` runs it: the tokenizer (byte-level BPE), the blocks (sentence and contiguous
mode, `--num_proc` processes), the graph (with the count prior) over the sentence blocks; in MB per second and per
CPU-second (this process's threads and the processes it started). A digest of each stage's result is recorded, so
that two checkouts can be shown to agree.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, add_results_dir, machine, write_record  # noqa: E402

STAGES = ("tokenizer", "tokenization", "graph")


def documents():
    """The generated corpus's documents, in a fixed order (endless: the caller stops at the size it wants)."""
    from modeling_brillm.training.data import embedded_corpus

    paragraphs = embedded_corpus()
    docs = ["\n\n".join(paragraphs[i:i + 10]) for i in range(0, len(paragraphs), 10)]
    stdlib = os.path.dirname(os.__file__)
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py")) + glob.glob(os.path.join(stdlib, "*", "*.py"))):
        if "site-packages" not in path and os.sep + "test" not in path:
            with open(path, encoding="utf-8", errors="replace") as handle:
                docs.append(handle.read())
    while True:
        yield from docs


def write_corpus(path: str, size_bytes: int) -> int:
    """Write documents to `path` (JSONL, a "text" field) until `size_bytes` of text; returns the text bytes."""
    written = 0
    with open(path, "w", encoding="utf-8") as handle:
        for doc in documents():
            if written >= size_bytes:
                break
            handle.write(json.dumps({"text": doc}) + "\n")
            written += len(doc.encode("utf-8"))
    return written


def cpu_seconds() -> float:
    """CPU time of this process's threads and of its finished child processes (datasets.map's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Timed:
    """Wall and CPU seconds of the `with` body."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), cpu_seconds()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, cpu_seconds() - self.cpu


class OneProcess:
    """The accelerator's part `tokenize_splits` uses: this process is the main one."""

    is_main_process = True

    def main_process_first(self):
        return contextlib.nullcontext()


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()[:16]


def blocks_digest(blocks) -> str:
    import numpy as np

    h = hashlib.sha256()
    for batch in blocks.with_format("numpy").iter(batch_size=65536):
        for name in ("input_ids", "attention_mask"):
            h.update(np.ascontiguousarray(batch[name], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def train_tokenizer(args, raw, tok_dir, stage):
    from transformers import AutoTokenizer

    from tokenization import build_tokenizer

    if "tokenizer" in args.stages:
        with Timed() as timed:
            tokenizer = build_tokenizer(raw["train"], kind="bpe", vocab_size=args.vocab_size, output_dir=tok_dir)
        stage("tokenizer", timed, tokens=len(tokenizer),
              vocab_digest=hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:16])
    else:  # a tokenizer from the first 200 documents: the later stages need one, fast
        build_tokenizer(raw["train"].select(range(min(200, len(raw["train"])))), kind="bpe",
                        vocab_size=args.vocab_size, output_dir=tok_dir)
    return AutoTokenizer.from_pretrained(tok_dir)  # as the other processes of a run load it


def cut_blocks(args, raw, tokenizer, stage):
    """The sentence blocks (for the graph), each mode timed when the tokenization stage is asked for."""
    from modeling_brillm.training.data import tokenize_splits

    sentence = None
    for mode in ("sentence", "contiguous") if "tokenization" in args.stages else ("sentence",):
        prep = SimpleNamespace(block_mode=mode, text_column="text", block_size=args.block_size,
                               preprocessing_num_workers=args.num_proc, overwrite_cache=True)
        with Timed() as timed:
            blocks = tokenize_splits(raw, tokenizer, prep, OneProcess())["train"]
        if "tokenization" in args.stages:
            stage(f"tokenization_{mode}", timed, blocks=len(blocks), blocks_digest=blocks_digest(blocks))
        sentence = blocks if mode == "sentence" else sentence
    return sentence


def run_stages(args, tmp: str) -> dict:
    import datasets

    from modeling_brillm import build_sparse_graph
    from modeling_brillm.training.data import block_sequences, load_raw_data

    datasets.disable_progress_bars()
    path = os.path.join(tmp, "train.jsonl")
    mb = write_corpus(path, int(args.size_mb * 1e6)) / 1e6
    t0 = time.perf_counter()
    raw, _ = load_raw_data(SimpleNamespace(dataset_name=None, train_file=path, validation_file=None,
                                           text_column="text", validation_split_percentage=0))
    figures = {"text_mb": mb, "documents": len(raw["train"]), "read_s": time.perf_counter() - t0}
    print(f"code: {ROOT}\nmachine: {machine()}\ntext: {mb:.1f} MB in {len(raw['train']):,} documents "
          f"(read in {figures['read_s']:.1f}s)")

    def stage(name, timed, **extra):
        figures[name] = {"seconds": timed.wall, "mb_per_s": mb / timed.wall, "cpu_seconds": timed.cpu,
                         "mb_per_cpu_s": mb / timed.cpu, **extra}
        print(f"{name:<24} {timed.wall:7.2f}s {mb / timed.wall:7.2f} MB/s {mb / timed.cpu:7.2f} MB/CPU-s  "
              + "  ".join(f"{k}={v}" for k, v in extra.items()))

    tokenizer = train_tokenizer(args, raw, os.path.join(tmp, "tokenizer"), stage)
    if "tokenization" in args.stages or "graph" in args.stages:
        sentence = cut_blocks(args, raw, tokenizer, stage)
    if "graph" in args.stages:
        with Timed() as timed:
            graph = build_sparse_graph(block_sequences(sentence, tokenizer.pad_token_id), len(tokenizer),
                                       ignore_ids=(tokenizer.pad_token_id,), with_prior=True)
        stage("graph", timed, edges=graph.num_edges,
              graph_digest=digest(graph.indptr.numpy(), graph.indices.numpy(), graph.counts.numpy()))
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size_mb", type=float, default=20.0, help="MB of generated training text. [20]")
    parser.add_argument("--num_proc", type=int, default=None,
                        help="--preprocessing_num_workers for the datasets.map calls (default: the code's default).")
    parser.add_argument("--vocab_size", type=int, default=4000)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    args = add_results_dir(parser).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "cache")  # nothing reused from an earlier run
        figures = run_stages(args, tmp)
    write_record("data_prep", args, figures)


if __name__ == "__main__":
    main()
