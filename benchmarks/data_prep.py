"""Data preparation speed: training the tokenizer, cutting blocks and building the graph, in MB of text per second.

    python benchmarks/data_prep.py --size_mb 20 --stages tokenizer tokenization graph

The text: Python's documentation and standard library, cycled to --size_mb; each stage timed once as
examples/pretrain.py runs it, per second and per CPU-second (children included).
"""

import argparse
import functools
import glob
import itertools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_results_dir, machine, write_record

STAGES = ("tokenizer", "tokenization", "graph")


def write_corpus(path: str, size_bytes: int) -> float:
    """JSONL documents ("text") until `size_bytes` of text; the MB written."""
    from modeling_brillm.training.data import embedded_corpus

    paragraphs, stdlib = embedded_corpus(), os.path.dirname(os.__file__)
    docs = ["\n\n".join(paragraphs[i:i + 10]) for i in range(0, len(paragraphs), 10)]
    for file in sorted(glob.glob(os.path.join(stdlib, "*.py")) + glob.glob(os.path.join(stdlib, "*", "*.py"))):
        if "site-packages" not in file and os.sep + "test" not in file:
            docs.append(Path(file).read_text(encoding="utf-8", errors="replace"))
    written = 0
    with open(path, "w", encoding="utf-8") as handle:
        for doc in itertools.cycle(docs):
            if written >= size_bytes:
                break
            handle.write(json.dumps({"text": doc}) + "\n")
            written += len(doc.encode("utf-8"))
    return written / 1e6


def cpu_seconds() -> float:  # this process's threads and its finished children (datasets.map's workers)
    return sum(sum(resource.getrusage(who)[:2]) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def run_stages(args, tmp: str) -> dict:
    import datasets
    from accelerate import PartialState  # the accelerator's part tokenize_splits uses: one process, the main one
    from transformers import AutoTokenizer

    from modeling_brillm import build_sparse_graph
    from modeling_brillm.training.data import block_sequences, load_raw_data, tokenize_splits
    from tokenization import build_tokenizer

    datasets.disable_progress_bars()
    path, tok_dir = os.path.join(tmp, "train.jsonl"), os.path.join(tmp, "tokenizer")
    mb = write_corpus(path, int(args.size_mb * 1e6))
    raw, _ = load_raw_data(SimpleNamespace(dataset_name=None, train_file=path, validation_file=None,
                                           text_column="text", validation_split_percentage=0))
    figures = {"text_mb": mb, "documents": len(raw["train"])}
    print(f"machine: {machine()}\ntext: {mb:.1f} MB in {len(raw['train']):,} documents")

    def timed(name, work):
        wall, cpu = time.perf_counter(), cpu_seconds()
        result = work()
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        if name.split("_")[0] in args.stages:
            figures[name] = dict(seconds=wall, mb_per_s=mb / wall, cpu_seconds=cpu, mb_per_cpu_s=mb / cpu)
            print(f"{name:<24} {wall:7.2f}s {mb / wall:7.2f} MB/s {mb / cpu:7.2f} MB/CPU-s", flush=True)
        return result

    # without the tokenizer stage, one from the first 200 documents: the later stages need one, fast
    texts = raw["train"] if "tokenizer" in args.stages else raw["train"].select(range(min(200, len(raw["train"]))))
    timed("tokenizer", lambda: build_tokenizer(texts, kind="bpe", vocab_size=args.vocab_size, output_dir=tok_dir))
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)  # as the other processes of a run load it
    modes = ("sentence", "contiguous") if "tokenization" in args.stages else ("sentence",) * ("graph" in args.stages)
    blocks = {}
    for mode in modes:
        prep = SimpleNamespace(block_mode=mode, text_column="text", block_size=args.block_size,
                               preprocessing_num_workers=args.num_proc, overwrite_cache=True)
        blocks[mode] = timed(f"tokenization_{mode}", functools.partial(tokenize_splits, raw, tokenizer, prep,
                                                                     PartialState()))["train"]
    sentences = blocks.get("sentence")
    if "graph" in args.stages:
        timed("graph", lambda: build_sparse_graph(block_sequences(sentences, tokenizer.pad_token_id), len(tokenizer),
                                                  ignore_ids=(tokenizer.pad_token_id,), with_prior=True))
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size_mb", type=float, default=20.0, help="MB of generated training text")
    parser.add_argument("--num_proc", type=int, help="--preprocessing_num_workers (default: the code's default)")
    parser.add_argument("--vocab_size", type=int, default=4000)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    args = add_results_dir(parser).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "cache")  # nothing reused from an earlier run
        figures = run_stages(args, tmp)
    write_record("data_prep", args, figures, argv=argv)
    return figures


if __name__ == "__main__":
    main()
